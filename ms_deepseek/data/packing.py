"""Turning token ids into stored samples.

Label convention (one for the whole package, the HuggingFace one): ``labels`` is
aligned with ``input_ids``, NOT shifted. ``labels[t]`` is the token at position
``t`` itself (or ``IGNORE_INDEX`` = -100 where no loss is taken); the model
shifts inside its loss, predicting ``labels[t + 1]`` from position ``t``.

* Pretraining: every document becomes ``[bos] + ids + [eos]`` (bos only when the
  tokenizer has one; generation also starts from bos), documents are joined into
  one stream and cut into consecutive windows of ``seq_len`` tokens, with
  ``labels == input_ids``. The last partial window is padded with ``pad_id``,
  its labels -100 on the padding; a final window with fewer than 2 real tokens
  holds no prediction and is dropped (counted).
* SFT: one conversation per sample (:func:`ms_deepseek.data.chat.encode_chat`),
  longer ones truncated to ``seq_len`` and counted; samples left without any
  target token are dropped and counted (they would give a 0/0 loss).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Dict, Iterator, List, Sequence

import numpy as np

from ms_deepseek.data.chat import IGNORE_INDEX, encode_chat

Row = Dict[str, np.ndarray]


@dataclass
class PackStats:
    """Counts written to meta.json and printed in the summary line."""

    documents: int = 0  # documents (or conversations) tokenized
    skipped_empty: int = 0  # empty / whitespace-only documents skipped
    samples: int = 0  # rows written
    tokens: int = 0  # real (non-padding) tokens in the rows
    target_tokens: int = 0  # labels != -100
    truncated: int = 0  # SFT conversations cut at seq_len
    dropped: int = 0  # rows with no prediction to make (see module doc)
    max_length: int = 0  # longest row (real tokens)
    max_token_id: int = -1

    def to_dict(self) -> Dict[str, int]:
        return asdict(self)

    def add_row(self, row: Row) -> None:
        length = int(row["length"])
        self.samples += 1
        self.tokens += length
        self.target_tokens += int((row["labels"] != IGNORE_INDEX).sum())
        self.max_length = max(self.max_length, length)
        if length:
            self.max_token_id = max(self.max_token_id, int(row["input_ids"][:length].max()))


def make_row(ids: np.ndarray, labels: np.ndarray, length: int) -> Row:
    return {
        "input_ids": ids.astype(np.int32, copy=False),
        "labels": labels.astype(np.int32, copy=False),
        "length": np.int32(length),
    }


class Packer:
    """Packs a stream of documents into ``seq_len`` windows (see module doc)."""

    def __init__(self, seq_len: int, bos_id, eos_id: int, pad_id: int, stats: PackStats):
        self.seq_len, self.bos_id, self.eos_id, self.pad_id = seq_len, bos_id, eos_id, pad_id
        self.stats = stats
        self._parts: List[np.ndarray] = []
        self._count = 0

    def add(self, ids: Sequence[int]) -> Iterator[Row]:
        """Add one document's ids (without specials); yield the windows it completes."""
        head = [self.bos_id] if self.bos_id is not None else []
        doc = np.asarray(head + list(ids) + [self.eos_id], dtype=np.int32)
        self.stats.documents += 1
        self._parts.append(doc)
        self._count += doc.size
        if self._count < self.seq_len:
            return
        stream = np.concatenate(self._parts)
        n_full = stream.size // self.seq_len
        windows = stream[: n_full * self.seq_len].reshape(n_full, self.seq_len)  # [n_full, seq_len]
        rest = stream[n_full * self.seq_len :]
        self._parts, self._count = [rest], rest.size
        for w in windows:
            row = make_row(w, w.copy(), self.seq_len)
            self.stats.add_row(row)
            yield row

    def finish(self) -> Iterator[Row]:
        """The last partial window, padded (pad_id in input_ids, -100 in labels)."""
        if self._count == 0:
            return
        stream = np.concatenate(self._parts)
        self._parts, self._count = [], 0
        if stream.size < 2:
            self.stats.dropped += 1
            return
        ids = np.full(self.seq_len, self.pad_id, dtype=np.int32)
        labels = np.full(self.seq_len, IGNORE_INDEX, dtype=np.int32)
        ids[: stream.size] = stream
        labels[: stream.size] = stream
        row = make_row(ids, labels, stream.size)
        self.stats.add_row(row)
        yield row


def sft_row(tokenizer, messages: Sequence[dict], seq_len: int, stats: PackStats):
    """One conversation -> a row (truncated to seq_len, counted), or None when nothing is trained on."""
    ids, labels = encode_chat(tokenizer, messages)
    stats.documents += 1
    if len(ids) > seq_len:
        stats.truncated += 1
        ids, labels = ids[:seq_len], labels[:seq_len]
    # A target at position 0 is never predicted (the model shifts), hence labels[1:].
    if not any(label != IGNORE_INDEX for label in labels[1:]):
        stats.dropped += 1
        return None
    row = make_row(np.asarray(ids, dtype=np.int32), np.asarray(labels, dtype=np.int32), len(ids))
    stats.add_row(row)
    return row
