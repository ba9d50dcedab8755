"""A training step's input batches: the first one read up front, k micro-batches stacked into one.

* :func:`first_batch_checked`: an unreadable dataset fails as one line before anything compiles;
* :func:`stack_micro_batches`: a step's k micro-batches -> one [k * b, T] pair.
"""

from __future__ import annotations

from typing import Dict, List

import numpy as np

from ms_deepseek.core.errors import UserError


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
