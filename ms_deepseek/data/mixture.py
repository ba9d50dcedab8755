"""Weighted mixtures of prepared folders (pretraining or SFT): exact proportions, seeded, resumable.

``data.path: [{path: data/web, weight: 0.7}, {path: data/code, weight: 0.3}]`` makes
:func:`ms_deepseek.data.dataset.build_train_dataset` return a :class:`MixtureDataset`.

How the global sample stream is made (the same on every run and every rank):

* positions 0, 1, 2, ... of the stream come in chunks of :data:`CHUNK`; every chunk holds
  each source exactly ``round(weight share * CHUNK)`` times (largest remainders), in the
  order of ``permutation`` by ``default_rng([seed, 0x6D6978, chunk])``: the proportions
  hold exactly at every chunk boundary and within a chunk up to sampling noise;
* the ``i``-th draw of source ``s`` is sample ``epoch_order(i // N_s)[i % N_s]`` of that
  source: its own seeded permutation per epoch (``default_rng([seed, s, epoch])``), so
  a small source repeats (epochs) while a large one is still in its first;
* rank ``r`` of ``W`` reads positions ``r, r+W, ...`` of each step's ``W*B`` positions
  (or blocks of ``block_rows`` positions: ``data.batches.rank_positions``), as the single-folder
  dataset does. The position (samples drawn) is global, so it stays
  valid when the world size or batch size changes between runs; the per-source counts
  (``source_counts``) are global too and go into ``state.json`` and the metrics.

Samples are read with MindSpore's ``MindDataset`` + ``SubsetSampler``, one reader per
source for a window of :data:`WINDOW` steps, and interleaved on the host. Every batch is
[B, seq_len]: SFT conversations (shorter than seq_len) are padded to it (pad id / -100, as
the validation set is), so a mixture has one static shape, which a sharded graph
(SEMI_AUTO_PARALLEL: every rank compiles the same shape) needs; there are no length buckets.
"""

from __future__ import annotations

from typing import Dict, Iterator, List, Optional

import numpy as np

from ms_deepseek.core.errors import UserError
from ms_deepseek.data.batches import RankShare
from ms_deepseek.data.chat import IGNORE_INDEX

CHUNK = 4096  # stream positions per exact-proportion chunk
WINDOW = 16  # steps read per batch of MindDataset readers


# More repetitions of a source than this get a warning at start: repeating data up to ~4 epochs is worth
# about as much as fresh data, beyond that returns fall quickly (Muennighoff et al. 2023, "Scaling
# Data-Constrained Language Models").
MAX_EPOCHS = 4.0


def chunk_counts(weights: List[float], chunk: int = CHUNK) -> np.ndarray:
    """Draws of each source per chunk: weight shares of ``chunk``, rounded by largest remainders."""
    w = np.asarray(weights, dtype=np.float64)
    exact = w / w.sum() * chunk
    counts = np.floor(exact).astype(np.int64)
    order = np.argsort(-(exact - counts), kind="stable")
    counts[order[: chunk - int(counts.sum())]] += 1
    return counts


class MixtureDataset:
    """Endless batches of a weighted mixture of prepared folders of one format (see module doc).

    parts: one single-folder ``TrainDataset`` per source (batch 1, world 1): its files, its
        validation hold-out and its seeded epoch order; names / weights: per source.
    """

    def __init__(
        self,
        parts,
        names: List[str],
        weights: List[float],
        *,
        batch_size: int,
        share: RankShare,
        seed: int,
        state: Optional[Dict] = None,
    ):
        self.share = share
        # a window is a whole number of the blocks the ranks read together
        self.window = WINDOW * max(1, share.block_rows // batch_size)
        self.parts, self.names, self.weights = parts, list(names), [float(w) for w in weights]
        self.batch_size, self.rank, self.world_size, self.seed = batch_size, share.rank, share.world, seed
        self.data_dir = parts[0].data_dir
        self.format = parts[0].format  # the sources share it (check_same_preparation)
        self.seq_len, self.pad_id = parts[0].seq_len, parts[0].pad_id
        self.num_samples = [p.num_samples for p in parts]
        self.steps_per_epoch = None  # sources cycle at their own pace
        self.counts = chunk_counts(self.weights)
        if (self.counts == 0).any():
            i = int(np.argmin(self.counts))
            raise UserError(
                f"data.path[{i}]: weight {self.weights[i]} is too small to draw even once in {CHUNK} samples"
            )
        self.samples, self.steps = 0, 0
        self._chunk_cache: Dict[int, np.ndarray] = {}
        self._order_cache: Dict[tuple, np.ndarray] = {}
        if state is not None:
            self._restore(state)

    def repeat_warnings(self, total_samples: int, max_epochs: float = MAX_EPOCHS) -> List[str]:
        """One line per source the run will read more than ``max_epochs`` times over ``total_samples``
        draws (steps x global batch), from its weight and size."""
        share = np.asarray(self.counts, dtype=np.float64) / float(np.sum(self.counts))
        out = []
        for i, (name, n) in enumerate(zip(self.names, self.num_samples)):
            epochs = share[i] * total_samples / max(n, 1)
            if epochs > max_epochs:
                out.append(
                    f"data.path[{i}]: {name} ({n} samples, weight {self.weights[i]:g}) is read about "
                    f"{epochs:.1f} times over this run's {total_samples} samples, more than {max_epochs:g} "
                    f"epochs (lower its weight or add data)"
                )
        return out

    # ------------------------------------------------------------------ position

    @property
    def source_counts(self) -> Dict[str, int]:
        """Samples drawn so far from each source, over all ranks."""
        return dict(zip(self.names, (int(c) for c in self._drawn_before(self.samples))))

    def state_dict(self) -> Dict:
        return {
            "mixture": True,
            "steps": self.steps,
            "samples": self.samples,
            "seed": self.seed,
            "sources": self.names,
            "weights": self.weights,
            "num_samples": self.num_samples,
            "holdout": [p.holdout for p in self.parts],
            "source_counts": self.source_counts,
        }

    def load_state_dict(self, state: Dict) -> None:
        """Continue from a previous :meth:`state_dict` (before the first batch is read), as ``state=`` does."""
        self._restore(state)

    def _restore(self, state: Dict) -> None:
        if not state.get("mixture"):
            raise UserError(
                "resume: the checkpoint was trained on one data folder, the recipe now lists a "
                "mixture in data.path; the same data is needed to continue exactly"
            )
        for key, now in (
            ("seed", self.seed),
            ("weights", self.weights),
            ("num_samples", self.num_samples),
            ("holdout", [p.holdout for p in self.parts]),
        ):
            if state.get(key) != now:
                raise UserError(
                    f"resume: the mixture's data position was saved with {key}={state.get(key)!r}, "
                    f"now {now!r}; the same sources, weights and seed are needed to continue exactly"
                )
        self.samples, self.steps = int(state["samples"]), int(state["steps"])

    # ------------------------------------------------------------------ order

    def _chunk(self, c: int) -> np.ndarray:
        """Source index of every position of chunk ``c`` [CHUNK]."""
        if c not in self._chunk_cache:
            if len(self._chunk_cache) > 4:
                self._chunk_cache.clear()
            pool = np.repeat(np.arange(len(self.parts)), self.counts)
            self._chunk_cache[c] = np.random.default_rng([self.seed, 0x6D6978, c]).permutation(pool)
        return self._chunk_cache[c]

    def _drawn_before(self, position: int) -> np.ndarray:
        """Draws of each source among stream positions [0, position)."""
        full, part = divmod(position, CHUNK)
        out = self.counts * full
        if part:
            out = out + np.bincount(self._chunk(full)[:part], minlength=len(self.parts))
        return out

    def _sources(self, start: int, n: int) -> np.ndarray:
        """Source index of positions [start, start + n)."""
        out, pos = [], start
        while pos < start + n:
            c, off = divmod(pos, CHUNK)
            take = min(CHUNK - off, start + n - pos)
            out.append(self._chunk(c)[off : off + take])
            pos += take
        return np.concatenate(out)

    def _sample(self, s: int, draw: int) -> int:
        epoch, pos = divmod(int(draw), self.num_samples[s])
        key = (s, epoch)
        if key not in self._order_cache:
            if len(self._order_cache) > 4 * len(self.parts):
                self._order_cache.clear()
            self._order_cache[key] = self.parts[s].epoch_order(epoch)
        return int(self._order_cache[key][pos])

    def window_draws(self, start: int, steps: int):
        """For ``steps`` steps from stream position ``start``: (source, sample index) of this rank's rows,
        in batch order [steps * B] each."""
        G = self.world_size * self.batch_size
        src = self._sources(start, steps * G)  # [steps * G]
        # draw number of each position within its source: draws before the window + running count
        onehot = src[:, None] == np.arange(len(self.parts))[None, :]  # [steps * G, S]
        draw = (np.cumsum(onehot, axis=0) - 1)[np.arange(src.size), src] + self._drawn_before(start)[src]
        mine = self.share.positions(steps * G)  # rank r: r, r+W, ... (or blocks)
        return src[mine], np.asarray([self._sample(s, d) for s, d in zip(src[mine], draw[mine])], np.int64)

    # ------------------------------------------------------------------ iteration

    def _read(self, src: np.ndarray, idx: np.ndarray) -> Dict[str, np.ndarray]:
        ids = np.empty((src.size, self.seq_len), np.int32)  # [rows, T]
        labels = np.empty((src.size, self.seq_len), np.int32)  # [rows, T]
        for s in np.unique(src):
            rows = np.nonzero(src == s)[0]
            # MindRecord's sampler takes each index at most once (and no more than the folder holds):
            # read the distinct samples, then place them (a small source may repeat within a window)
            uniq, where = np.unique(idx[rows], return_inverse=True)
            # SFT samples are shorter than seq_len: padded (pretraining windows fill the row)
            got_ids = np.full((uniq.size, self.seq_len), self.pad_id, np.int32)  # [distinct, T]
            got_labels = np.full((uniq.size, self.seq_len), IGNORE_INDEX, np.int32)  # [distinct, T]
            pipe = self.parts[s].mind_dataset(uniq, ["input_ids", "labels"])
            it = pipe.create_dict_iterator(num_epochs=1, output_numpy=True)
            try:
                for j, sample in enumerate(it):
                    n = sample["input_ids"].shape[0]
                    got_ids[j, :n], got_labels[j, :n] = sample["input_ids"], sample["labels"]
            finally:
                it.stop()
            ids[rows], labels[rows] = got_ids[where], got_labels[where]
        return {"input_ids": ids, "labels": labels}

    def __iter__(self) -> Iterator[Dict[str, np.ndarray]]:
        B, G = self.batch_size, self.world_size * self.batch_size
        while True:
            src, idx = self.window_draws(self.samples, self.window)
            rows = self._read(src, idx)
            for t in range(self.window):
                self.samples += G
                self.steps += 1
                yield {k: v[t * B : (t + 1) * B] for k, v in rows.items()}
