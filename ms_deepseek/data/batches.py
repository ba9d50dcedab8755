"""A training step's input batches: the first one read up front, k micro-batches stacked into one.

* :func:`first_batch_checked`: an unreadable dataset fails as one line before anything compiles;
* :func:`stack_micro_batches`: a step's k micro-batches -> one [k * b, T] pair;
* :func:`rank_positions`: which positions of the global sample stream a data-parallel rank reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List

import numpy as np

from ms_deepseek.core.errors import UserError


def rank_positions(n: int, rank: int, world: int, block_rows: int = 1) -> np.ndarray:
    """The positions among ``n`` consecutive ones of the stream (``n`` a multiple of ``world * block_rows``) that
    rank ``rank`` of ``world`` reads: ``block_rows`` consecutive positions out of every ``world * block_rows``.

    ``block_rows`` 1 is the strided layout of MindDataset's own ``num_shards`` / ``shard_id`` (rank r: positions r,
    r+W, ...). A sharded step (SEMI_AUTO_PARALLEL) with k micro-batches of b rows per rank reads blocks of k * b:
    MindSpore takes each rank's [k * b, T] input as one contiguous block of the global [k * W * b, T] input
    (``mindspore/parallel/_utils.py`` ``_to_full_tensor``: rank r's rows at ``r * k * b``) and cuts micro-batch
    ``i`` from the global input as rows ``[i * W * b, (i + 1) * W * b)`` (``mindspore/nn/wrap/cell_wrapper.py``
    ``_MicroBatch``), so micro-batch i holds the stream's positions ``[i * W * b, (i + 1) * W * b)`` of the step,
    as on one device, only when each rank reads its step's rows as one block."""
    if n % (world * block_rows):
        raise ValueError(f"{n} positions do not split into blocks of {block_rows} over {world} ranks")
    return np.arange(n, dtype=np.int64).reshape(-1, world, block_rows)[:, rank, :].reshape(-1)


@dataclass(frozen=True)
class RankShare:
    """A data-parallel rank's share of the stream: rank ``rank`` of ``world``, reading ``block_rows`` consecutive
    positions together (:func:`rank_positions`)."""

    rank: int
    world: int
    block_rows: int = 1

    def positions(self, n: int) -> np.ndarray:
        return rank_positions(n, self.rank, self.world, self.block_rows)


def stack_micro_batches(parts: List[Dict[str, np.ndarray]], pad_id: int):
    """k micro-batches -> one [k * b, T] pair, in order (SFT buckets of one step padded to the longest)."""
    from ms_deepseek.data.chat import IGNORE_INDEX

    if len(parts) == 1:
        return parts[0]["input_ids"], parts[0]["labels"]
    width = max(p["input_ids"].shape[1] for p in parts)
    ids, labels = [], []
    for p in parts:
        extra = width - p["input_ids"].shape[1]
        # pads go after the real tokens: causal attention keeps them invisible, -100 keeps them out of the loss
        ids.append(np.pad(p["input_ids"], ((0, 0), (0, extra)), constant_values=pad_id) if extra else p["input_ids"])
        labels.append(np.pad(p["labels"], ((0, 0), (0, extra)), constant_values=IGNORE_INDEX) if extra else p["labels"])
    return np.concatenate(ids), np.concatenate(labels)


def first_batch_checked(dataset):
    """The batch iterator, with its first batch already read: unreadable shards fail here, as one line."""
    import itertools

    it = iter(dataset)
    try:
        first = next(it)
    except UserError:
        raise
    except Exception as exc:  # MindSpore's reader raises RuntimeError with a multi-line report
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
        # the report's "Dataset Pipeline Error Message" section holds the reason, e.g. "Failed to read file."
        reason = next((ln for ln in lines if ln.startswith("[ERROR]")), lines[0] if lines else type(exc).__name__)
        raise UserError(
            f"data.path: {dataset.data_dir}: cannot read the training samples "
            f"({reason[:300]}); prepare the folder again with `ms-deepseek prepare-data`"
        ) from None
    return itertools.chain([first], it)
