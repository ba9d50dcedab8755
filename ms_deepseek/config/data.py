"""The recipe's ``data:`` section.

Loaded with :func:`ms_deepseek.core.schema.from_dict` (unknown keys and wrong types fail
there, naming the key); impossible values fail here, naming ``data.<key>``.

Example recipe section::

    data:
      path: data/my_corpus        # a folder written by `ms-deepseek prepare-data`
      format: sft                 # optional: the folder's meta.json records it (pretrain or sft)
      shuffle: true
      seed: 1234

With ``path`` left out and ``embedded_default: true`` (the default), training
uses the embedded default corpus (Python standard library sources, tokenized
with a small sentencepiece model trained on them), built once and cached.

A weighted mixture lists several prepared folders (same tokenizer and sequence
length); samples are drawn in the weights' proportions (see data/mixture.py)::

    data:
      path:
        - {path: data/web, weight: 0.7}
        - {path: data/code, weight: 0.3}

Validation: a prepared folder, or a fraction of the training data held out (the
tail of each folder's samples; training never sees them)::

    data:
      validation: {fraction: 0.02}      # or {path: data/my_val}
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Literal, Optional, Union

from ms_deepseek.core.errors import UserError
from ms_deepseek.core.schema import MAX_SEED, MAX_TOKENS, check_at_most

DEFAULT_EMBEDDED_SEQ_LEN = 256


@dataclass
class DataSource:
    """One folder of a weighted mixture (``data.path`` as a list)."""

    path: str
    weight: float = 1.0

    def __post_init__(self) -> None:
        if not self.path.strip():
            raise UserError("data.path[].path: empty string")
        if not self.weight > 0:
            raise UserError(f"data.path[].weight: must be > 0, got {self.weight} ({self.path})")


@dataclass
class ValidationConfig:
    """Where the validation samples come from: ``path`` (a prepared folder) or ``fraction``
    (held out of the training data: the last ``ceil(fraction * N)`` samples of each folder)."""

    path: Optional[str] = None
    fraction: Optional[float] = None

    def __post_init__(self) -> None:
        if (self.path is None) == (self.fraction is None):
            raise UserError(
                "data.validation: set exactly one of path (a prepared folder) or fraction "
                "(held out of the training data)"
            )
        if self.path is not None and not self.path.strip():
            raise UserError("data.validation.path: empty string")
        if self.fraction is not None and not 0 < self.fraction < 0.5:
            raise UserError(f"data.validation.fraction: must be in (0, 0.5), got {self.fraction}")


@dataclass
class DataConfig:
    """Where the training samples come from and how they are batched.

    path: folder of prepared MindRecord shards (``meta.json`` inside), or None
        for the embedded default corpus.
    format: "pretrain" (packed windows) or "sft" (one conversation per sample);
        None (the default) takes the prepared folder's (``meta.json``), pretrain for the
        embedded default. When set it must match the folder.
    seq_len: expected sequence length; None takes it from ``meta.json``. For the
        embedded default it is the packing length (default 256).
    tokenizer: optional tokenizer path (file or folder). When set it must be the
        tokenizer the data was prepared with (compared by sha256), e.g. the
        tokenizer of the checkpoint being fine-tuned.
    shuffle / seed: a fresh seeded permutation every epoch, identical across runs.
    bucket_boundaries: SFT only: the padded lengths of the length buckets,
        strictly increasing, each <= seq_len (seq_len is always added as the
        last bucket). None: powers of two from 32 up to seq_len.
    num_workers: MindDataset reader threads (capped at the CPU count).
    embedded_default: use the embedded corpus when ``path`` is not set.
    embedded_vocab_size / embedded_max_bytes: size of the embedded corpus's
        tokenizer and of its text.
    """

    path: Union[str, List[DataSource], None] = None
    format: Optional[Literal["pretrain", "sft"]] = None
    seq_len: Optional[int] = None
    tokenizer: Optional[str] = None
    shuffle: bool = True
    seed: int = 1234
    bucket_boundaries: Optional[List[int]] = None
    num_workers: int = 2
    embedded_default: bool = True
    embedded_vocab_size: int = 8192
    embedded_max_bytes: int = 12_000_000
    validation: Optional[ValidationConfig] = None

    def __post_init__(self) -> None:
        self._check_path_list()
        self._check_numbers()
        if self.bucket_boundaries is not None:
            self._check_buckets()
        self._check_embedded()
        self._check_path()

    def _check_path_list(self) -> None:
        if isinstance(self.path, list):
            if not self.path:
                raise UserError("data.path: empty list (one folder, or a list of {path, weight})")
            if len(self.path) == 1:  # a one-folder list is that folder (its weight is moot)
                self.path = self.path[0].path
            else:
                names = [s.path for s in self.path]
                dup = next((n for n in names if names.count(n) > 1), None)
                if dup is not None:
                    raise UserError(f"data.path: {dup} is listed twice (give it one weight)")

    def _check_numbers(self) -> None:
        if self.seq_len is not None and self.seq_len < 2:
            raise UserError(f"data.seq_len: must be at least 2 (one input and one target token), got {self.seq_len}")
        check_at_most("data.seq_len", self.seq_len, MAX_TOKENS, "tokens of one sequence")
        check_at_most("data.seed", self.seed, MAX_SEED, "numpy's seed range")
        check_at_most("data.bucket_boundaries", self.bucket_boundaries, MAX_TOKENS, "tokens of one sequence")
        check_at_most("data.embedded_max_bytes", self.embedded_max_bytes, 2**40, "bytes of text")
        if self.seed < 0:
            raise UserError(f"data.seed: must be >= 0, got {self.seed}")
        if not 1 <= self.num_workers <= 64:
            raise UserError(f"data.num_workers: must be between 1 and 64, got {self.num_workers}")

    def _check_buckets(self) -> None:
        b = self.bucket_boundaries
        if not b:
            raise UserError("data.bucket_boundaries: empty list (leave it out for automatic buckets)")
        if any(x < 2 for x in b):
            raise UserError(f"data.bucket_boundaries: every length must be >= 2, got {b}")
        if any(y <= x for x, y in zip(b, b[1:])):
            raise UserError(f"data.bucket_boundaries: must be strictly increasing, got {b}")
        if self.seq_len is not None and b[-1] > self.seq_len:
            raise UserError(f"data.bucket_boundaries: {b[-1]} is longer than data.seq_len {self.seq_len}")
        # left out with a folder: checked against the folder's format when it is read; the embedded
        # default (no data.path) is pretraining text
        if self.format == "pretrain" or (self.format is None and self.path is None):
            raise UserError(
                "data.bucket_boundaries: only used with data.format 'sft' (pretraining windows all have length seq_len)"
            )
        if isinstance(self.path, list):
            raise UserError(
                "data.bucket_boundaries: a weighted mixture pads every sample to seq_len "
                "(no length buckets); leave it out"
            )

    def _check_embedded(self) -> None:
        if not 512 <= self.embedded_vocab_size <= 65536:
            raise UserError(f"data.embedded_vocab_size: must be between 512 and 65536, got {self.embedded_vocab_size}")
        if self.embedded_max_bytes < 10_000:
            raise UserError(f"data.embedded_max_bytes: must be at least 10000, got {self.embedded_max_bytes}")

    def _check_path(self) -> None:
        if self.path is None:
            if self.format == "sft":
                raise UserError(
                    "data.path: format 'sft' needs a prepared SFT folder "
                    "(the embedded default corpus is pretraining text)"
                )
            if not self.embedded_default:
                raise UserError(
                    "data.path: not set and data.embedded_default is false; "
                    "prepare a folder with `ms-deepseek prepare-data` and set data.path"
                )
        elif isinstance(self.path, str) and not self.path.strip():
            raise UserError("data.path: empty string (leave it out to use the embedded default)")

    @property
    def sources(self) -> List[DataSource]:
        """The prepared folders as a list (one folder: weight 1); empty for the embedded default."""
        if self.path is None:
            return []
        if isinstance(self.path, str):
            return [DataSource(self.path, 1.0)]
        return list(self.path)

    @property
    def primary_path(self) -> Optional[str]:
        """The (first) prepared folder: its tokenizer and seq_len are the mixture's (all must agree)."""
        return self.sources[0].path if self.path is not None else None

    @property
    def embedded_seq_len(self) -> int:
        return self.seq_len if self.seq_len is not None else DEFAULT_EMBEDDED_SEQ_LEN
