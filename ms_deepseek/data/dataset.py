"""Training batches from a prepared folder: seeded, sharded per data-parallel rank, resumable.

``build_train_dataset(...)`` returns a :class:`TrainDataset`; iterating it yields
batches forever (epoch after epoch) as numpy dicts::

    {"input_ids": int32 [B, T], "labels": int32 [B, T]}

with labels aligned to input_ids (HF convention, -100 = no loss; the model
shifts). ``state_dict()`` after a batch is that batch's position; a dataset
built with ``state=``, or given it by ``load_state_dict`` before its first batch,
continues with exactly the batch an uninterrupted run would have produced next.

How the order is made (the same on every run and every rank):

* epoch ``e`` visits the samples in ``permutation(N)`` of
  ``numpy.random.default_rng([seed, e])`` (storage order when shuffle is off);
* rank ``r`` of ``W`` reads positions ``r, r+W, r+2W, ...`` of that order: the
  strided layout MindDataset's own ``num_shards``/``shard_id`` use, applied to
  the seeded order through a ``SubsetSampler`` (MindDataset's built-in shuffle
  draws from the process-global dataset seed and cannot start mid-epoch); a
  sharded step reads blocks of ``block_rows`` consecutive positions instead
  (:func:`ms_deepseek.data.batches.rank_positions` says why);
* pretraining: each step takes the next ``W*B`` positions (rank r gets its B of
  them); the tail of an epoch smaller than ``W*B`` is skipped. The position is
  global (``epoch``, ``samples_in_epoch``), the same on every rank, and stays
  valid when the world size or batch size changes between runs;
* SFT: MindSpore's ``bucket_batch_by_length`` groups the rank's samples into
  length buckets (full batches only), each batch padded to its bucket length
  (pad id / -100) so graph mode sees a handful of shapes. The number of batches
  a rank gets in an epoch is computed from ``lengths.npy`` without reading the
  shards, so the position is one number, the steps taken, the same on every
  rank; resuming maps it to (epoch, batch) and skips that many batches.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Union

import numpy as np

from ms_deepseek.config.data import DataConfig
from ms_deepseek.core.errors import UserError
from ms_deepseek.data.batches import RankShare, rank_positions
from ms_deepseek.data.chat import IGNORE_INDEX
from ms_deepseek.data.sources import ResolvedData, as_resolved, holdout_count
from ms_deepseek.data.storage import load_lengths, shard_paths


def bucket_lengths(seq_len: int, boundaries: Optional[Sequence[int]]) -> List[int]:
    """Padded lengths of the SFT buckets: ``boundaries`` (or powers of two from 32), ending at seq_len."""
    if boundaries is None:
        out, b = [], 32
        while b < seq_len:
            out.append(b)
            b *= 2
    else:
        out = list(boundaries)
        if out and out[-1] > seq_len:
            raise UserError(f"data.bucket_boundaries: {out[-1]} is longer than the data's seq_len {seq_len}")
    if not out or out[-1] < seq_len:
        out.append(seq_len)
    return out


def _length_of(length) -> int:
    return int(length)


class TrainDataset:
    """Endless, seeded, rank-sharded batches from a prepared folder (see module doc).

    Attributes: ``data_dir``, ``meta``, ``format``, ``seq_len``, ``num_samples``,
    ``pad_id``, ``batch_size``, ``rank``, ``world_size``, ``steps_per_epoch``
    (pretraining; None for SFT where it differs per rank and epoch).
    """

    def __init__(
        self,
        data_dir: Path,
        meta: Dict,
        *,
        batch_size: int,
        rank: int,
        world_size: int,
        seed: int,
        shuffle: bool = True,
        buckets: Optional[List[int]] = None,
        num_workers: int = 2,
        state: Optional[Dict] = None,
        holdout_fraction: Optional[float] = None,
        order_key: Sequence[int] = (),
        block_rows: int = 1,
    ):
        if block_rows > 1 and block_rows % batch_size:
            raise UserError(
                f"data: a rank's block of {block_rows} rows is not a whole number of batches of {batch_size}"
            )
        self.block_rows = block_rows
        self.data_dir, self.meta = data_dir, meta
        self.format, self.seq_len = meta["format"], int(meta["seq_len"])
        self.batch_size, self.rank, self.world_size = batch_size, rank, world_size
        self.seed, self.shuffle, self.num_workers = seed, shuffle, num_workers
        self.pad_id = int(meta["tokenizer"]["pad_id"])
        self.files = shard_paths(data_dir, meta)
        self.lengths = load_lengths(data_dir, meta)
        # data.validation.fraction: this folder's last samples are held out and never trained on
        self.holdout, self.order_key = holdout_count(int(self.lengths.size), holdout_fraction), tuple(order_key)
        self.lengths = self.lengths[: self.lengths.size - self.holdout]
        self.num_samples = int(self.lengths.size)
        if self.num_samples == 0:
            raise UserError(f"data.path: {data_dir} holds no samples")
        global_batch = batch_size * world_size
        if self.num_samples < global_batch:
            raise UserError(
                f"data.path: {data_dir} holds {self.num_samples} samples, fewer than one global batch "
                f"({batch_size} per rank x {world_size} ranks)"
            )
        self.buckets = buckets if self.format == "sft" else None
        group = world_size * block_rows  # positions the ranks read together
        per_group = block_rows // batch_size if block_rows > 1 else 1
        self.steps_per_epoch = (
            (self.num_samples // max(group, global_batch)) * per_group if self.format == "pretrain" else None
        )
        self.epoch, self.samples_in_epoch, self.batches_in_epoch, self.steps = 0, 0, 0, 0
        if state is not None:
            self._restore(state)
        if self.format == "sft":
            self._sft_batches(self.epoch)  # fail now, not at the first batch, if a rank gets no full batch

    # ------------------------------------------------------------------ position

    def state_dict(self) -> Dict:
        """The position after the last batch handed out (JSON-serialisable).

        Any rank's dict restores every rank: pretraining positions are global,
        SFT resumes from ``steps`` (its epoch / batches_in_epoch are this rank's own).
        """
        return {
            "steps": self.steps,
            "epoch": self.epoch,
            "samples_in_epoch": self.samples_in_epoch,
            "batches_in_epoch": self.batches_in_epoch,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_samples": self.num_samples,
            "format": self.format,
            "batch_size": self.batch_size,
            "world_size": self.world_size,
            "buckets": self.buckets,
            "holdout": self.holdout,
            "block_rows": self.block_rows,
        }

    def load_state_dict(self, state: Dict) -> None:
        """Continue from a previous :meth:`state_dict` (before the first batch is read), as ``state=`` does."""
        self._restore(state)
        if self.format == "sft":
            self._sft_batches(self.epoch)  # fail now, not at the first batch, if a rank gets no full batch

    def _restore(self, state: Dict) -> None:
        missing = [k for k in ("steps", "epoch", "samples_in_epoch", "batches_in_epoch") if k not in state]
        if missing:
            raise UserError(f"resume: the saved data position has no {', '.join(missing)}")
        if state.get("holdout", 0) != self.holdout:
            raise UserError(
                f"resume: the run held out {state.get('holdout', 0)} validation samples of "
                f"{self.data_dir}, now {self.holdout} (data.validation changed); the same split is "
                "needed to continue exactly"
            )
        for key in ("seed", "shuffle", "num_samples", "format"):
            if state.get(key) != getattr(self, key):
                raise UserError(
                    f"resume: the data position was saved with {key}={state.get(key)!r}, "
                    f"now {getattr(self, key)!r} ({self.data_dir}); the same data and seed are needed "
                    "to continue exactly"
                )
        self.steps = int(state["steps"])
        if self.format == "pretrain":
            self.epoch, self.samples_in_epoch = int(state["epoch"]), int(state["samples_in_epoch"])
            self.batches_in_epoch = int(state["batches_in_epoch"])
            return
        for key in ("batch_size", "world_size", "buckets", "block_rows"):
            if state.get(key, 1 if key == "block_rows" else None) != getattr(self, key):
                raise UserError(
                    f"resume: SFT data position was saved with {key}={state.get(key)}, now "
                    f"{getattr(self, key)}; length bucketing continues exactly only with the same value"
                )
        # Each rank maps the shared step count to its own (epoch, batch in epoch).
        epoch, left = 0, self.steps
        while True:
            n = self._sft_batches(epoch)
            if left < n:
                break
            left -= n
            epoch += 1
        self.epoch, self.batches_in_epoch = epoch, left

    # ------------------------------------------------------------------ order

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Global sample order of ``epoch`` (indices into the stored samples)."""
        if not self.shuffle:
            return np.arange(self.num_samples, dtype=np.int64)
        # order_key: a mixture's source index, so each source has its own seeded stream
        return np.random.default_rng([self.seed, *self.order_key, epoch]).permutation(self.num_samples)

    def _bucket_of(self, lengths: np.ndarray) -> np.ndarray:
        return np.searchsorted(np.asarray(self.buckets), lengths, side="left")  # first bucket >= length

    def _mine(self, order: np.ndarray) -> np.ndarray:
        """This rank's positions of ``order`` (its whole blocks; ``data.batches.rank_positions``)."""
        if self.block_rows == 1:
            return order[self.rank :: self.world_size]
        n = order.size - order.size % (self.world_size * self.block_rows)
        return order[:n][rank_positions(n, self.rank, self.world_size, self.block_rows)]

    def _sft_batches(self, epoch: int) -> int:
        """Full batches this rank gets in ``epoch`` (bucketing keeps only full batches per bucket)."""
        mine = self._mine(self.epoch_order(epoch))
        counts = np.bincount(self._bucket_of(self.lengths[mine]), minlength=len(self.buckets))
        n = int((counts // self.batch_size).sum())
        if n == 0:
            raise UserError(
                f"data.path: rank {self.rank} gets no full batch of {self.batch_size} in epoch {epoch} "
                f"({mine.size} samples spread over length buckets {self.buckets}); use fewer buckets "
                "(data.bucket_boundaries) or a smaller batch"
            )
        return n

    # ------------------------------------------------------------------ iteration

    def mind_dataset(self, indices: np.ndarray, columns: List[str]):
        """MindSpore's reader of the samples ``indices`` (their ``columns``)."""
        import mindspore.dataset as ds

        # MindSpore refuses more reader threads than CPUs; the setting is a ceiling.
        workers = max(1, min(self.num_workers, os.cpu_count() or 1))
        return ds.MindDataset(
            self.files, columns_list=columns, sampler=ds.SubsetSampler(indices.tolist()), num_parallel_workers=workers
        )

    def _pretrain_epoch(self) -> Iterator[Dict[str, np.ndarray]]:
        step_samples = self.batch_size * self.world_size
        group = max(step_samples, self.world_size * self.block_rows)  # positions the ranks read together
        start = self.samples_in_epoch
        groups = (self.num_samples - start) // group
        if groups <= 0:
            return
        block = self.epoch_order(self.epoch)[start : start + groups * group]
        mine = self._mine(block)  # rank r: positions r, r+W, ... of the block (or its blocks of block_rows)
        pipe = self.mind_dataset(mine, ["input_ids", "labels"]).batch(self.batch_size, drop_remainder=True)
        it = pipe.create_dict_iterator(num_epochs=1, output_numpy=True)
        try:
            for batch in it:
                self.samples_in_epoch += step_samples
                self.batches_in_epoch += 1
                self.steps += 1
                yield {"input_ids": batch["input_ids"], "labels": batch["labels"]}
        finally:
            it.stop()

    def _sft_epoch(self) -> Iterator[Dict[str, np.ndarray]]:
        mine = self._mine(self.epoch_order(self.epoch))
        total = self._sft_batches(self.epoch)
        if self.batches_in_epoch >= total:
            return
        pipe = self.mind_dataset(mine, ["input_ids", "labels", "length"])
        # MindSpore buckets are [0, b0), [b0, b1), ...: boundary = padded length + 1.
        pipe = pipe.bucket_batch_by_length(
            ["length"],
            [b + 1 for b in self.buckets],
            [self.batch_size] * (len(self.buckets) + 1),
            element_length_function=_length_of,
            pad_info={"input_ids": (None, self.pad_id), "labels": (None, IGNORE_INDEX)},
            drop_remainder=True,
        )
        if self.batches_in_epoch:
            pipe = pipe.skip(self.batches_in_epoch)
        it = pipe.create_dict_iterator(num_epochs=1, output_numpy=True)
        try:
            for batch in it:
                self.batches_in_epoch += 1
                self.steps += 1
                yield self._pad_to_bucket(batch)
        finally:
            it.stop()

    def _pad_to_bucket(self, batch: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
        # bucket_batch_by_length pads to the longest row of the batch (its
        # pad_to_bucket_boundary had no effect in MindSpore 2.9 here); pad on to
        # the bucket's length so the shapes stay few.
        ids, labels = batch["input_ids"], batch["labels"]
        width = self.buckets[int(self._bucket_of(np.asarray([ids.shape[1]]))[0])]
        extra = width - ids.shape[1]
        if extra:
            ids = np.pad(ids, ((0, 0), (0, extra)), constant_values=self.pad_id)  # [B, width]
            labels = np.pad(labels, ((0, 0), (0, extra)), constant_values=IGNORE_INDEX)  # [B, width]
        return {"input_ids": ids.astype(np.int32, copy=False), "labels": labels.astype(np.int32, copy=False)}

    def __iter__(self) -> Iterator[Dict[str, np.ndarray]]:
        epoch_fn = self._pretrain_epoch if self.format == "pretrain" else self._sft_epoch
        while True:
            yield from epoch_fn()
            self.epoch += 1
            self.samples_in_epoch = 0
            self.batches_in_epoch = 0


def build_train_dataset(
    data: Union[DataConfig, ResolvedData],
    batch_size: int,
    rank: int = 0,
    world_size: int = 1,
    *,
    state: Optional[Dict] = None,
    max_positions: Optional[int] = None,
    vocab_size: Optional[int] = None,
    cache_dir: Union[str, Path, None] = None,
    seed: Optional[int] = None,
    progress: bool = True,
    static_shapes: bool = False,
    block_rows: int = 1,
):
    """The training batches for one data-parallel rank: a :class:`TrainDataset`, or for a weighted
    mixture (``data.path`` a list) a :class:`ms_deepseek.data.mixture.MixtureDataset`.

    data: the run's :class:`ResolvedData`, or the recipe's ``data:`` section, resolved here
        (:func:`resolve_data`; with ``path`` unset the embedded default corpus is built under
        ``cache_dir``, default :func:`default_cache_dir`, the first time). A ``validation.fraction``
        holds the tail of every folder out of training.
    batch_size: per-rank micro batch; rank / world_size: data-parallel coordinates.
    state: a previous ``state_dict()`` to continue exactly.
    max_positions: the model's ``max_position_embeddings``; longer data fails (when resolved here).
    vocab_size: the model's vocabulary size; token ids at or above it fail (when resolved here).
    seed: overrides ``data_cfg.seed`` (e.g. the recipe's global seed).
    static_shapes: every batch [B, seq_len] (a sharded run: under SEMI_AUTO_PARALLEL all ranks
        run one graph of one shape, while each data-parallel rank's SFT length buckets differ
        from batch to batch): SFT gets the single bucket seq_len. A mixture is always static.
    block_rows: the rank reads this many consecutive positions of every ``world_size * block_rows`` (1: strided;
        a sharded step with k micro-batches of ``batch_size``: k * batch_size, ``data.batches.rank_positions``).
    """
    _check_position(batch_size, rank, world_size)
    resolved = as_resolved(
        data, max_positions=max_positions, vocab_size=vocab_size, cache_dir=cache_dir, progress=progress
    )
    data_cfg, folders, metas = resolved.config, resolved.sources, resolved.metas
    seed = data_cfg.seed if seed is None else seed
    fraction = data_cfg.validation.fraction if data_cfg.validation is not None else None
    seq_len = resolved.seq_len
    buckets = None
    if metas[0]["format"] == "sft":
        buckets = [seq_len] if static_shapes else bucket_lengths(seq_len, data_cfg.bucket_boundaries)

    common = dict(
        seed=seed,
        shuffle=data_cfg.shuffle,
        buckets=buckets,
        num_workers=data_cfg.num_workers,
        holdout_fraction=fraction,
    )

    def part(i, b, r, w, part_state=None):
        order_key = (i,) if len(folders) > 1 else ()
        return TrainDataset(
            folders[i][1], metas[i], batch_size=b, rank=r, world_size=w, state=part_state, order_key=order_key, **common
        )

    if len(folders) == 1:
        return TrainDataset(
            folders[0][1],
            metas[0],
            batch_size=batch_size,
            rank=rank,
            world_size=world_size,
            state=state,
            block_rows=block_rows,
            **common,
        )
    # each source is read sample by sample in its own seeded order; the mixture batches them
    return _mixture(
        [part(i, 1, 0, 1) for i in range(len(folders))],
        folders,
        (batch_size, rank, world_size, block_rows),
        seed,
        state,
    )


def _check_position(batch_size: int, rank: int, world_size: int) -> None:
    if batch_size < 1:
        raise UserError(f"batch size: must be >= 1, got {batch_size}")
    if not 0 <= rank < world_size:
        raise UserError(f"rank {rank} is outside the data-parallel world of size {world_size}")


def _mixture(parts, folders, position, seed: int, state: Optional[Dict]):
    """The weighted mixture of the sources' datasets, batched for one data-parallel ``position`` (batch size,
    rank, world size, block rows)."""
    from ms_deepseek.data.mixture import MixtureDataset

    batch_size, rank, world_size, block_rows = position
    sources, weights = [str(f) for _, f, _ in folders], [w for _, _, w in folders]
    return MixtureDataset(
        parts,
        sources,
        weights,
        batch_size=batch_size,
        share=RankShare(rank, world_size, block_rows),
        seed=seed,
        state=state,
    )
