"""One tokenizer wrapper for training, data preparation and generation.

Two on-disk formats are read:

* a HuggingFace ``tokenizer.json`` (library ``tokenizers``), as released with
  DeepSeek-V2: byte-level BPE, with ``tokenizer_config.json`` beside it naming
  the special tokens (bos ``<｜begin▁of▁sentence｜>``, eos ``<｜end▁of▁sentence｜>``);
* a sentencepiece ``.model`` (the embedded default corpus trains one).

``encode`` never adds special tokens: callers put ``bos_id`` / ``eos_id`` where
the format wants them (see :mod:`ms_deepseek.data.chat` and
:mod:`ms_deepseek.data.packing`), so both formats behave the same.
"""

from __future__ import annotations

import hashlib
import json
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple, Union

from ms_deepseek.core.errors import UserError
from ms_deepseek.core.safe_io import json_loads, regular_file

# Special-token names tried when tokenizer_config.json does not name them.
_BOS_NAMES = ("<｜begin▁of▁sentence｜>", "<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>")
_EOS_NAMES = ("<｜end▁of▁sentence｜>", "</s>", "<|end_of_text|>", "<|endoftext|>", "<eos>")
_PAD_NAMES = ("<｜▁pad▁｜>", "<pad>", "<|pad|>", "[PAD]")


class Tokenizer(ABC):
    """Common interface over a HuggingFace ``tokenizer.json`` or a sentencepiece ``.model``.

    Attributes: ``vocab_size`` (largest id + 1), ``bos_id`` (None if the tokenizer
    has none), ``eos_id``, ``pad_id`` (the eos id when there is no pad token),
    ``files`` (the files that define it, to copy next to data or checkpoints),
    ``kind`` ("hf" or "sentencepiece").
    """

    kind: str
    canonical_name: str  # the name a folder holds it under (what find_tokenizer_file looks for)
    files: List[Path]
    vocab_size: int
    bos_id: Optional[int]
    eos_id: int
    pad_id: int

    def encode(self, text: str, add_bos: bool = False) -> List[int]:
        ids = self._encode(text)
        return [self.bos_id] + ids if add_bos and self.bos_id is not None else ids

    @abstractmethod
    def encode_batch(self, texts: Sequence[str]) -> List[List[int]]:
        """Token ids of many texts at once (parallel inside the tokenizer library)."""

    @abstractmethod
    def encode_with_offsets(self, text: str) -> Tuple[List[int], List[int]]:
        """Token ids and, for each token, the character index in ``text`` where it starts."""

    @abstractmethod
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; special tokens left out unless ``skip_special_tokens`` is False."""

    @abstractmethod
    def _encode(self, text: str) -> List[int]:
        """Token ids of ``text`` without special tokens."""

    def sha256(self) -> str:
        """Hash of the defining files' bytes (not their names: ``tok.model`` and ``tokenizer.model``
        holding the same bytes are one tokenizer), the main file first, each prefixed by its length."""
        h = hashlib.sha256()
        for f in self.files:
            data = f.read_bytes()
            h.update(len(data).to_bytes(8, "little") + data)
        return h.hexdigest()

    def saved_names(self) -> List[str]:
        """File names in a folder that holds this tokenizer: the main file under ``canonical_name``."""
        return [self.canonical_name] + [f.name for f in self.files[1:]]

    def describe(self) -> Dict[str, object]:
        return {
            "kind": self.kind,
            "files": self.saved_names(),
            "vocab_size": self.vocab_size,
            "bos_id": self.bos_id,
            "eos_id": self.eos_id,
            "pad_id": self.pad_id,
        }


def _token_name(value) -> Optional[str]:
    """tokenizer_config.json writes special tokens as a string or as {"content": ...}."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


class HFTokenizer(Tokenizer):
    kind = "hf"
    canonical_name = "tokenizer.json"

    def __init__(self, path: Path):
        from tokenizers import Tokenizer as _RustTokenizer

        try:
            self._tok = _RustTokenizer.from_file(str(path))
        except Exception as exc:  # the library raises plain Exception subclasses
            raise UserError(f"{path}: not a readable tokenizer.json ({str(exc).splitlines()[0][:200]})") from None
        self.files = [path]
        config: Dict[str, object] = {}
        cfg_path = path.parent / "tokenizer_config.json"
        if cfg_path.is_file():
            try:
                config = json_loads(cfg_path.read_text(encoding="utf-8"), cfg_path)
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise UserError(f"{cfg_path}: not readable JSON ({exc})") from None
            if not isinstance(config, dict):
                raise UserError(f"{cfg_path}: expected a JSON object")
            self.files.append(cfg_path)
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1 if vocab else 0
        self.bos_id = self._special(config, "bos_token", _BOS_NAMES, path)
        self.eos_id = self._special(config, "eos_token", _EOS_NAMES, path)
        if self.eos_id is None:
            raise UserError(f"{path}: no end-of-sequence token found (set eos_token in tokenizer_config.json)")
        pad = self._special(config, "pad_token", _PAD_NAMES, path)
        self.pad_id = self.eos_id if pad is None else pad

    def _special(self, config, key, fallbacks, path) -> Optional[int]:
        name = _token_name(config.get(key))
        if name is not None:
            tid = self._tok.token_to_id(name)
            if tid is None:
                raise UserError(f"{path.parent / 'tokenizer_config.json'}: {key} {name!r} is not in {path.name}")
            return tid
        if key in config:  # explicitly null: the tokenizer has none
            return None
        for name in fallbacks:
            tid = self._tok.token_to_id(name)
            if tid is not None:
                return tid
        return None

    def _encode(self, text: str) -> List[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> List[List[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def encode_with_offsets(self, text: str) -> Tuple[List[int], List[int]]:
        enc = self._tok.encode(text, add_special_tokens=False)
        return enc.ids, [start for start, _ in enc.offsets]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)


class SentencePieceTokenizer(Tokenizer):
    kind = "sentencepiece"
    canonical_name = "tokenizer.model"

    def __init__(self, path: Path):
        import sentencepiece as spm

        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.Load(str(path))
        except (OSError, RuntimeError) as exc:
            raise UserError(f"{path}: not a readable sentencepiece model ({str(exc).splitlines()[0][:200]})") from None
        self.files = [path]
        self.vocab_size = self._sp.get_piece_size()
        self.bos_id = self._sp.bos_id() if self._sp.bos_id() >= 0 else None
        if self._sp.eos_id() < 0:
            raise UserError(f"{path}: the sentencepiece model has no eos id (train it with eos_id >= 0)")
        self.eos_id = self._sp.eos_id()
        self.pad_id = self._sp.pad_id() if self._sp.pad_id() >= 0 else self.eos_id

    def _encode(self, text: str) -> List[int]:
        return self._sp.encode(text)

    def encode_batch(self, texts: Sequence[str]) -> List[List[int]]:
        return self._sp.encode(list(texts), num_threads=2)

    def encode_with_offsets(self, text: str) -> Tuple[List[int], List[int]]:
        result = self._sp.encode_as_offset_mapping(text)  # character offsets
        return list(result["ids"]), [start for start, _ in result["offsets"]]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        ids = [int(i) for i in ids]
        if skip_special_tokens:
            return self._sp.decode([i for i in ids if not self._sp.IsControl(i)])
        # Control pieces decode to "": render them by name between decoded runs.
        out, run = [], []
        for i in ids:
            if self._sp.IsControl(i):
                out.append(self._sp.decode(run))
                out.append(self._sp.id_to_piece(i))
                run = []
            else:
                run.append(i)
        out.append(self._sp.decode(run))
        return "".join(out)


def find_tokenizer_file(path: Union[str, Path]) -> Path:
    """The tokenizer file for ``path``: the file itself, or tokenizer.json / tokenizer.model in a folder."""
    p = Path(path).expanduser()
    if p.is_dir():
        for name in ("tokenizer.json", "tokenizer.model"):
            if (p / name).is_file():
                return p / name
        raise UserError(f"{p}: no tokenizer.json or tokenizer.model in this folder")
    if not p.exists():
        raise UserError(f"{p}: tokenizer not found (no such file or folder)")
    return regular_file(p, "tokenizer file")  # a FIFO would block the open below forever


def load_tokenizer(path: Union[str, Path]) -> Tokenizer:
    """Load a tokenizer from a file (``tokenizer.json`` / ``*.model``) or a folder holding one.

    A folder can be a HuggingFace checkpoint, an ms_deepseek checkpoint or a
    prepared data folder (``prepare-data`` copies the tokenizer in).
    """
    f = find_tokenizer_file(path)
    try:
        head = f.open("rb").read(1)
    except OSError as exc:
        raise UserError(f"{f}: cannot read tokenizer ({exc.strerror})") from None
    if f.suffix == ".json" or head in (b"{", b"["):
        return HFTokenizer(f)
    return SentencePieceTokenizer(f)


def train_sentencepiece(texts: Sequence[str], vocab_size: int, out_file: Path) -> None:
    """Train a byte-fallback BPE sentencepiece model on ``texts`` and write it to ``out_file``.

    Ids: unk 0, bos 1, eos 2, pad 3. Settings suit source code: no normalisation,
    whitespace kept as is (indentation pieces), newline and tab as their own
    symbols, digits split, byte fallback so no text is ever unknown.
    """
    import io

    import sentencepiece as spm

    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(texts),
            model_writer=model,
            model_type="bpe",
            vocab_size=vocab_size,
            byte_fallback=True,
            character_coverage=1.0,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            add_dummy_prefix=False,
            split_digits=True,
            allow_whitespace_only_pieces=True,
            user_defined_symbols=["\n", "\t"],
            unk_id=0,
            bos_id=1,
            eos_id=2,
            pad_id=3,
            num_threads=2,
            max_sentence_length=1 << 16,
            minloglevel=2,
        )
    except RuntimeError as exc:
        raise UserError(
            f"vocab size {vocab_size}: sentencepiece training failed ({str(exc).splitlines()[-1][:200]})"
        ) from None
    out_file.write_bytes(model.getvalue())
