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

import fcntl
import math
import os
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np

from ms_deepseek.config.data import DataConfig
from ms_deepseek.core.errors import UserError
from ms_deepseek.data.batches import RankShare, rank_positions
from ms_deepseek.data.chat import IGNORE_INDEX
from ms_deepseek.data.storage import DestinationRaced, find_meta, load_lengths, load_meta, shard_paths


def default_cache_dir() -> Path:
    """Where the embedded default corpus is built once: $MS_DEEPSEEK_CACHE or ~/.cache/ms_deepseek."""
    return Path(os.environ.get("MS_DEEPSEEK_CACHE", "~/.cache/ms_deepseek")).expanduser()


def ensure_embedded_default(cfg: DataConfig, cache_dir: Union[str, Path, None] = None, progress: bool = True) -> Path:
    """The embedded default corpus for ``cfg``, built under ``cache_dir/data/`` if not there yet.

    Safe to call from every rank at once (:func:`_built_once`).
    """
    import platform

    from ms_deepseek.data.prepare import prepare_embedded_default

    py = "".join(platform.python_version_tuple()[:2])
    name = f"embedded-py{py}-s{cfg.embedded_seq_len}-v{cfg.embedded_vocab_size}-b{cfg.embedded_max_bytes}"

    def build(dest: Path) -> str:
        return prepare_embedded_default(
            dest,
            seq_len=cfg.embedded_seq_len,
            vocab_size=cfg.embedded_vocab_size,
            max_bytes=cfg.embedded_max_bytes,
            progress=progress,
        )[1]

    return _built_once(name, build, cache_dir, "embedded default corpus" if progress else None)


def ensure_embedded_chat(cfg: DataConfig, cache_dir: Union[str, Path, None] = None) -> Path:
    """The embedded chat corpus (SFT: :func:`ms_deepseek.data.prepare.prepare_embedded_chat`) at ``cfg``'s
    embedded sequence length, tokenized with the embedded default corpus's tokenizer; built once under
    ``cache_dir/data/``."""
    import platform

    from ms_deepseek.data.prepare import prepare_embedded_chat
    from ms_deepseek.data.tokenizer import find_tokenizer_file

    tokenizer = find_tokenizer_file(ensure_embedded_default(cfg, cache_dir, progress=False))
    py = "".join(platform.python_version_tuple()[:2])
    name = f"embedded-chat-py{py}-s{cfg.embedded_seq_len}-v{cfg.embedded_vocab_size}-b{cfg.embedded_max_bytes}"
    return _built_once(name, lambda dest: prepare_embedded_chat(dest, tokenizer, cfg.embedded_seq_len)[1], cache_dir)


def _built_once(name: str, build, cache_dir: Union[str, Path, None], announce: Optional[str] = None) -> Path:
    """``cache_dir/data/<name>``, made by ``build(dest) -> summary`` if not there yet. Safe to call from every
    rank at once: the folder is installed by one atomic rename, ranks on one host wait for the first builder
    instead of all building, and a process that loses the race across hosts uses the winner's (identical)
    folder."""
    dest = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    dest = dest / "data" / name
    if find_meta(dest):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest.parent / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if find_meta(dest):
            return dest
        try:
            summary = build(dest)
            if announce:
                print(f"{announce}: {summary}")
        except (DestinationRaced, UserError):
            if not find_meta(dest):
                raise
    return dest


def resolve_data_dir(cfg: DataConfig, cache_dir: Union[str, Path, None] = None, progress: bool = True) -> Path:
    """The prepared folder ``cfg`` points at: ``data.path``, or the embedded default when it is unset.

    A ``data.path`` that does not exist is an error (never silently replaced).
    """
    if cfg.path is not None:
        return Path(cfg.path).expanduser()
    return ensure_embedded_default(cfg, cache_dir, progress)


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


def holdout_count(num_samples: int, fraction: Optional[float]) -> int:
    """Samples held out for validation at the tail of a folder of ``num_samples``."""
    return 0 if not fraction else min(num_samples - 1, max(1, math.ceil(fraction * num_samples)))


def checked_meta(
    data_dir: Path,
    data_cfg: DataConfig,
    key: str,
    *,
    max_positions: Optional[int] = None,
    vocab_size: Optional[int] = None,
) -> Dict:
    """A prepared folder's meta.json, checked against the recipe and the model (errors name ``key``)."""
    meta = load_meta(data_dir, key)
    where = f"{key}: {data_dir}"
    if data_cfg.format is not None and meta["format"] != data_cfg.format:
        raise UserError(
            f"data.format: '{data_cfg.format}' but {data_dir} was prepared as '{meta['format']}' "
            "(leave data.format out to use the folder's)"
        )
    if data_cfg.bucket_boundaries is not None and meta["format"] != "sft":
        raise UserError(
            f"data.bucket_boundaries: only used with SFT data, and {data_dir} was prepared as "
            f"'{meta['format']}' (pretraining windows all have length seq_len)"
        )
    seq_len = int(meta["seq_len"])
    if data_cfg.seq_len is not None and data_cfg.seq_len != seq_len:
        raise UserError(
            f"data.seq_len: {data_cfg.seq_len} but {data_dir} was prepared with seq_len {seq_len} "
            "(re-run prepare-data, or leave data.seq_len out)"
        )
    if max_positions is not None and seq_len > max_positions:
        raise UserError(
            f"{where}: sequences of {seq_len} tokens are longer than the model's "
            f"max_position_embeddings {max_positions}"
        )
    max_id = int(meta["counts"]["max_token_id"])
    if vocab_size is not None and max_id >= vocab_size:
        raise UserError(
            f"{where}: holds token id {max_id} but the model's vocab_size is {vocab_size} "
            f"(the data's tokenizer has {meta['tokenizer']['vocab_size']} tokens)"
        )
    if data_cfg.tokenizer is not None:
        from ms_deepseek.data.tokenizer import load_tokenizer

        if load_tokenizer(data_cfg.tokenizer).sha256() != meta["tokenizer"]["sha256"]:
            raise UserError(
                f"data.tokenizer: {data_cfg.tokenizer} is not the tokenizer {data_dir} was prepared with "
                f"({meta['tokenizer']['source']})"
            )
    return meta


def check_same_preparation(first: Tuple[str, Path, Dict], other: Tuple[str, Path, Dict]) -> None:
    """Two folders read into one model must share tokenizer, sequence length and format."""
    (key0, dir0, meta0), (key, folder, meta) = first, other
    if meta["format"] != meta0["format"]:
        raise UserError(
            f"{key}: {folder} was prepared as '{meta['format']}', {key0} {dir0} as "
            f"'{meta0['format']}'; all folders must share one format"
        )
    if int(meta["seq_len"]) != int(meta0["seq_len"]):
        raise UserError(
            f"{key}: {folder} was prepared with seq_len {meta['seq_len']}, {key0} {dir0} with "
            f"{meta0['seq_len']}; all folders must share one sequence length"
        )
    if meta["tokenizer"]["sha256"] != meta0["tokenizer"]["sha256"]:
        raise UserError(
            f"{key}: {folder} was prepared with tokenizer {meta['tokenizer']['source']} "
            f"({meta['tokenizer']['vocab_size']} tokens), {key0} {dir0} with "
            f"{meta0['tokenizer']['source']} ({meta0['tokenizer']['vocab_size']} tokens); "
            "all folders must share one tokenizer"
        )


def source_folders(data_cfg: DataConfig, cache_dir=None, progress: bool = True) -> List[Tuple[str, Path, float]]:
    """(recipe key, folder, weight) of every training source (the embedded default when none is set)."""
    if data_cfg.path is None:
        return [("data.path", resolve_data_dir(data_cfg, cache_dir, progress), 1.0)]
    if isinstance(data_cfg.path, str):
        return [("data.path", Path(data_cfg.path).expanduser(), 1.0)]
    return [(f"data.path[{i}]", Path(s.path).expanduser(), s.weight) for i, s in enumerate(data_cfg.path)]


def build_train_dataset(
    data_cfg: DataConfig,
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

    data_cfg: the recipe's ``data:`` section; with ``path`` unset the embedded
        default corpus is built under ``cache_dir`` (default
        :func:`default_cache_dir`) the first time. A ``validation.fraction``
        holds the tail of every folder out of training.
    batch_size: per-rank micro batch; rank / world_size: data-parallel coordinates.
    state: a previous ``state_dict()`` to continue exactly.
    max_positions: the model's ``max_position_embeddings``; longer data fails.
    vocab_size: the model's vocabulary size; token ids at or above it fail.
    seed: overrides ``data_cfg.seed`` (e.g. the recipe's global seed).
    static_shapes: every batch [B, seq_len] (a sharded run: under SEMI_AUTO_PARALLEL all ranks
        run one graph of one shape, while each data-parallel rank's SFT length buckets differ
        from batch to batch): SFT gets the single bucket seq_len. A mixture is always static.
    block_rows: the rank reads this many consecutive positions of every ``world_size * block_rows`` (1: strided;
        a sharded step with k micro-batches of ``batch_size``: k * batch_size, ``data.batches.rank_positions``).
    """
    _check_position(batch_size, rank, world_size)
    seed = data_cfg.seed if seed is None else seed
    fraction = data_cfg.validation.fraction if data_cfg.validation is not None else None
    folders, metas = _checked_sources(data_cfg, cache_dir, progress, max_positions, vocab_size)
    seq_len = int(metas[0]["seq_len"])
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


def _checked_sources(data_cfg: DataConfig, cache_dir, progress: bool, max_positions, vocab_size):
    """The recipe's data folders ((key, folder, weight)) and their checked metadata; every source prepared
    like the first."""
    folders = source_folders(data_cfg, cache_dir, progress)
    metas = [
        checked_meta(folder, data_cfg, key, max_positions=max_positions, vocab_size=vocab_size)
        for key, folder, _ in folders
    ]
    for (key, folder, _), meta in zip(folders[1:], metas[1:]):
        check_same_preparation((folders[0][0], folders[0][1], metas[0]), (key, folder, meta))
    return folders, metas
