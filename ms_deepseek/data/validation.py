"""The validation set: a prepared folder, or the tail of the training folders held out.

``build_validation(data_cfg, batch_size, rank, world_size, eval_batches, ...)`` returns
this rank's validation batches, read once and kept in memory (numpy dicts, every batch
[B, seq_len]: SFT samples padded to seq_len, so evaluation compiles one graph):

* ``data.validation.path``: every sample of that folder (checked like a training folder:
  same format, tokenizer and seq_len as the training data);
* ``data.validation.fraction``: the last ``ceil(fraction * N)`` samples of each training
  folder (the same samples :class:`~ms_deepseek.data.dataset.TrainDataset` leaves out).
  The tail, not a random pick: packed windows of one document sit next to each other,
  so a contiguous hold-out keeps a document's text from straddling the split.

The samples are put in one seeded order (``default_rng([seed, 0x76616C])``, the same on
every run, resume included), the first ``eval_batches x B x W`` are kept (fewer when the
set is smaller: whole batches for every rank), and rank ``r`` takes positions
``r, r+W, ...``. Every validation uses exactly these batches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple, Union

import numpy as np

from ms_deepseek.config.data import DataConfig
from ms_deepseek.core.errors import UserError
from ms_deepseek.data.chat import IGNORE_INDEX
from ms_deepseek.data.sources import ResolvedData, as_resolved, holdout_count
from ms_deepseek.data.storage import load_lengths, shard_paths


@dataclass
class ValidationSet:
    batches: List[Dict[str, np.ndarray]]  # this rank's, [B, T] each
    total_samples: int  # samples in the validation set
    used_samples: int  # samples evaluated per validation (all ranks)
    description: str  # for the start line


def _lengths(folder: Path, meta: Dict) -> np.ndarray:
    return load_lengths(folder, meta)


def _read(folder: Path, meta: Dict, indices: np.ndarray, seq_len: int, pad_id: int):
    """Rows ``indices`` of a folder, padded to seq_len: ([n, T] ids, [n, T] labels)."""
    import mindspore.dataset as ds

    ids = np.full((indices.size, seq_len), pad_id, np.int32)  # [n, T]
    labels = np.full((indices.size, seq_len), IGNORE_INDEX, np.int32)  # [n, T]
    if indices.size == 0:
        return ids, labels
    pipe = ds.MindDataset(
        shard_paths(folder, meta),
        columns_list=["input_ids", "labels"],
        sampler=ds.SubsetSampler(indices.tolist()),
        num_parallel_workers=1,
    )
    it = pipe.create_dict_iterator(num_epochs=1, output_numpy=True)
    try:
        for row, sample in enumerate(it):
            n = sample["input_ids"].shape[0]
            ids[row, :n], labels[row, :n] = sample["input_ids"], sample["labels"]
    finally:
        it.stop()
    return ids, labels


def _enough_hint(val, pieces, per_step: int) -> str:
    """The --set that makes the validation set hold one batch per worker: the smallest hold-out
    (rounded up to 3 decimals) that does, while it stays under the 0.5 limit; else a folder."""
    folder = "give a validation folder (--set 'data.validation={path: DIR}')"
    if val.fraction is None:
        return "use a larger validation folder, or lower train.micro_batch_size"
    sizes = [_lengths(f, meta).size for f, meta, _ in pieces]
    fraction = math.ceil(1000 * per_step / sum(sizes)) / 1000
    if fraction < 0.5 and sum(holdout_count(n, fraction) for n in sizes) >= per_step:
        return f"hold out more with --set data.validation.fraction={fraction:g}, or {folder}"
    return f"the training data is too small to hold a batch out: {folder}, or lower train.micro_batch_size"


def build_validation(
    data: Union[DataConfig, ResolvedData],
    batch_size: int,
    rank: int,
    world_size: int,
    eval_batches: int,
    *,
    max_positions: Optional[int] = None,
    vocab_size: Optional[int] = None,
    seed: Optional[int] = None,
    cache_dir=None,
) -> Optional[ValidationSet]:
    """This rank's validation batches (see module doc), or None without ``data.validation``. ``data``: the run's
    :class:`~ms_deepseek.data.sources.ResolvedData`, or the recipe's ``data:`` section, resolved here with
    ``max_positions``, ``vocab_size`` and ``cache_dir``."""
    data_cfg = data.config if isinstance(data, ResolvedData) else data
    val = data_cfg.validation
    if val is None:
        return None
    resolved = as_resolved(
        data, max_positions=max_positions, vocab_size=vocab_size, cache_dir=cache_dir, progress=False
    )
    seed = data_cfg.seed if seed is None else seed
    seq_len, pad_id = resolved.seq_len, resolved.pad_id
    pieces = []  # (folder, meta, storage indices)
    if resolved.validation is not None:
        folder, meta = resolved.validation
        pieces.append((folder, meta, np.arange(_lengths(folder, meta).size)))
        what = f"{folder}"
    else:
        for (_, folder, _), meta in zip(resolved.sources, resolved.metas):
            n = _lengths(folder, meta).size
            pieces.append((folder, meta, np.arange(n - holdout_count(n, val.fraction), n)))
        what = f"{val.fraction:g} of the training data held out"
    per_step = batch_size * world_size
    total = int(sum(p[2].size for p in pieces))
    if total < per_step:
        raise UserError(
            f"data.validation: {what} holds {total} samples, fewer than one batch per worker "
            f"({batch_size} x {world_size} workers); {_enough_hint(val, pieces, per_step)}"
        )
    return _assemble(pieces, what, [seed, 0x76616C], batch_size, rank, world_size, eval_batches, seq_len, pad_id)


def source_names(data_cfg: DataConfig) -> List[str]:
    """A short name per training source (its folder's name; ``name-i`` where two share one): the ``<source>``
    of ``val_loss/<source>``."""
    folders = [Path(s.path).expanduser() for s in data_cfg.sources]
    base = [f.name or str(f) for f in folders]
    return [n if base.count(n) == 1 else f"{n}-{i}" for i, n in enumerate(base)]


def build_validation_by_source(
    data: Union[DataConfig, ResolvedData],
    batch_size: int,
    rank: int,
    world_size: int,
    eval_batches: int,
    *,
    max_positions: Optional[int] = None,
    vocab_size: Optional[int] = None,
    seed: Optional[int] = None,
    cache_dir=None,
) -> Tuple[Dict[str, ValidationSet], List[str]]:
    """A weighted mixture (``data.path`` a list) with ``data.validation.fraction``: every source's own held-out
    tail as a validation set of its own (``eval_batches`` batches at most, seeded per source), for
    ``val_loss/<source>`` beside the overall ``val_loss``. Returns ({name: set}, notes): a source whose tail
    holds less than one batch per worker gets a note instead of a set. ({}, []) for anything else (one folder,
    or a validation folder, which is not split by source). ``data`` as for :func:`build_validation`."""
    data_cfg = data.config if isinstance(data, ResolvedData) else data
    val = data_cfg.validation
    if val is None or val.fraction is None or not isinstance(data_cfg.path, list):
        return {}, []
    resolved = as_resolved(
        data, max_positions=max_positions, vocab_size=vocab_size, cache_dir=cache_dir, progress=False
    )
    seed = data_cfg.seed if seed is None else seed
    seq_len, pad_id = resolved.seq_len, resolved.pad_id
    sets, notes = {}, []
    sources = zip(resolved.sources, resolved.metas, source_names(data_cfg))
    for i, ((key, folder, _), meta, name) in enumerate(sources):
        n = _lengths(folder, meta).size
        piece = (folder, meta, np.arange(n - holdout_count(n, val.fraction), n))
        if piece[2].size < batch_size * world_size:
            notes.append(
                f"val_loss/{name}: not logged: {key} holds out {piece[2].size} samples, fewer than one "
                f"batch per worker ({batch_size} x {world_size})"
            )
            continue
        sets[name] = _assemble(
            [piece],
            f"{name}'s held-out tail",
            [seed, 0x76616C, i + 1],
            batch_size,
            rank,
            world_size,
            eval_batches,
            seq_len,
            pad_id,
        )
    return sets, notes


def _assemble(
    pieces, what: str, seed, batch_size: int, rank: int, world_size: int, eval_batches: int, seq_len: int, pad_id: int
) -> ValidationSet:
    """The seeded order over ``pieces`` ((folder, meta, storage indices)), the first whole batches for every
    rank, this rank's rows read."""
    # one list of (piece, storage index), then the seeded order
    where = np.concatenate([np.full(p[2].size, i) for i, p in enumerate(pieces)])
    index = np.concatenate([p[2] for p in pieces])
    total = int(index.size)
    per_step = batch_size * world_size
    order = np.random.default_rng(seed).permutation(total)
    used = min(eval_batches, total // per_step) * per_step
    mine = order[:used][rank::world_size]  # rank r: positions r, r+W, ...
    ids = np.empty((mine.size, seq_len), np.int32)  # [rows, T]
    labels = np.empty((mine.size, seq_len), np.int32)  # [rows, T]
    for i, (folder, meta, _) in enumerate(pieces):
        rows = np.nonzero(where[mine] == i)[0]
        ids[rows], labels[rows] = _read(folder, meta, index[mine][rows], seq_len, pad_id)
    batches = [
        {"input_ids": ids[j : j + batch_size], "labels": labels[j : j + batch_size]}
        for j in range(0, mine.size, batch_size)
    ]
    return ValidationSet(batches, total, used, f"{what}: {used} of {total} samples per validation")
