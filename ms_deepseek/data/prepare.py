"""Tokenize a corpus into a prepared data folder (MindRecord shards + meta.json).

Two entry points:

* :func:`prepare_data`: the user's jsonl / parquet / text files with their tokenizer;
* :func:`prepare_embedded_default`: the embedded default corpus (Python standard
  library sources) with a sentencepiece tokenizer trained on it in a few seconds.

See :mod:`ms_deepseek.data.packing` for the sample layout and label convention
and :mod:`ms_deepseek.data.storage` for the folder layout.
"""

from __future__ import annotations

import platform
import shutil
import sys
import sysconfig
import time
from pathlib import Path
from typing import Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

from ms_deepseek.core.errors import UserError
from ms_deepseek.data.packing import Packer, PackStats, sft_row
from ms_deepseek.data.readers import discover_files, iter_documents
from ms_deepseek.data.storage import ShardWriter
from ms_deepseek.data.tokenizer import Tokenizer, load_tokenizer, train_sentencepiece

_ENCODE_BATCH = 256  # documents tokenized per call (the libraries parallelise inside a call)


def _check_seq_len(seq_len: int) -> None:
    if not isinstance(seq_len, int) or seq_len < 2:
        raise UserError(f"--seq-len: must be an integer >= 2, got {seq_len!r}")


def _progress(iterable: Iterable, enabled: bool, total: Optional[int] = None, desc: str = "tokenizing"):
    from ms_deepseek.core.progress import progress_bar

    return progress_bar(iterable, enabled=enabled, total=total, desc=desc, unit="doc", dynamic_ncols=True)


def _batched(items: Iterable, size: int) -> Iterator[list]:
    batch = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def _pack_pretrain(
    docs: Iterable[str], tokenizer: Tokenizer, seq_len: int, writer: ShardWriter, stats: PackStats
) -> None:
    packer = Packer(seq_len, tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id, stats)
    for batch in _batched(docs, _ENCODE_BATCH):
        texts = [d for d in batch if d.strip()]
        stats.skipped_empty += len(batch) - len(texts)
        for ids in tokenizer.encode_batch(texts):
            for row in packer.add(ids):
                writer.write(row)
    for row in packer.finish():
        writer.write(row)


def _write_tokenizer_files(tokenizer: Tokenizer, folder: Path) -> None:
    """Copy the tokenizer in under the names a folder is read by (``--tokenizer tok.model`` is
    saved as ``tokenizer.model``, which ``train`` and ``generate`` look for)."""
    for f, name in zip(tokenizer.files, tokenizer.saved_names()):
        if f.resolve() != (folder / name).resolve():
            shutil.copyfile(f, folder / name)


def _meta(fmt: str, seq_len: int, tokenizer: Tokenizer, source: str, stats: PackStats, sources) -> Dict:
    return {
        "format": fmt,
        "seq_len": seq_len,
        "label_convention": "labels aligned with input_ids (HF); the model shifts; -100 = no loss",
        "tokenizer": dict(tokenizer.describe(), source=source, sha256=tokenizer.sha256()),
        "counts": stats.to_dict(),
        "sources": sources,
    }


def _summary(stats: PackStats, writer: ShardWriter, seconds: float) -> str:
    extra = []
    if stats.truncated:
        extra.append(f"{stats.truncated} truncated to seq_len")
    if stats.dropped:
        extra.append(f"{stats.dropped} dropped with nothing to predict")
    if stats.skipped_empty:
        extra.append(f"{stats.skipped_empty} empty skipped")
    more = f"; {', '.join(extra)}" if extra else ""
    return (
        f"wrote {stats.samples} samples ({stats.tokens} tokens, {stats.target_tokens} trained on) from "
        f"{stats.documents} documents{more} in {writer.num_shards} shard(s) to {writer.output} "
        f"in {seconds:.1f} s"
    )


def _check_inputs_apart(inputs, output) -> None:
    """--output must neither hold an INPUT (--overwrite would delete it) nor lie inside one (the shards
    would be read back as input by the next run over that folder)."""
    from ms_deepseek.core.safe_io import is_inside

    for item in inputs:
        if is_inside(item, output):
            raise UserError(f"--output {output}: holds the input {item}; choose an output folder outside the inputs")
        if Path(item).is_dir() and is_inside(output, item):
            raise UserError(f"--output {output}: lies inside the input folder {item}; choose a folder outside it")


def prepare_data(
    inputs: Sequence[Union[str, Path]],
    output: Union[str, Path],
    tokenizer: Union[str, Path],
    seq_len: int,
    fmt: str = "pretrain",
    num_shards: int = 1,
    overwrite: bool = False,
    progress: bool = True,
) -> Tuple[Dict, str]:
    """Tokenize ``inputs`` (files or folders) into ``output``; returns (meta, summary line).

    Fails with a UserError (and leaves ``output`` untouched) on any bad input.
    """
    start = time.time()
    _check_seq_len(seq_len)
    if fmt not in ("pretrain", "sft"):
        raise UserError(f"--format: must be 'pretrain' or 'sft', got {fmt!r}")
    _check_inputs_apart(inputs, output)
    tok = load_tokenizer(tokenizer)
    files = discover_files(inputs)
    stats = PackStats()
    with ShardWriter(output, num_shards, overwrite) as writer:
        docs = (doc for _, doc in iter_documents(files, fmt))
        if fmt == "pretrain":
            _pack_pretrain(_progress(docs, progress), tok, seq_len, writer, stats)
        else:
            for messages in _progress(docs, progress):
                row = sft_row(tok, messages, seq_len, stats)
                if row is not None:
                    writer.write(row)
        _check_not_empty(stats, inputs, num_shards)
        _write_tokenizer_files(tok, writer.tmp)
        meta = _meta(
            fmt,
            seq_len,
            tok,
            str(Path(tokenizer).expanduser().absolute()),
            stats,
            [str(Path(i).expanduser().absolute()) for i in inputs],
        )
        meta = writer.install(meta)
    return meta, _summary(stats, writer, time.time() - start)


def _check_not_empty(stats: PackStats, inputs, num_shards: int) -> None:
    if stats.samples == 0:
        raise UserError(
            f"{', '.join(str(i) for i in inputs)}: no samples produced "
            f"({stats.documents} documents, {stats.skipped_empty} empty, {stats.dropped} dropped)"
        )
    if stats.samples < num_shards:
        raise UserError(f"--num-shards: {num_shards} shards for only {stats.samples} samples")


# --------------------------------------------------------------------------- embedded default corpus

_SKIP_PARTS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
_SAMPLE_BYTES = 2_000_000  # text the tokenizer is trained on (seconds, not minutes)


def stdlib_files(max_bytes: int) -> Tuple[Path, List[Path]]:
    """The standard library's *.py files in sorted relative-path order, tests and
    site-packages left out, up to ``max_bytes`` in total (the first file always)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise UserError(f"{root}: the Python standard library folder is missing; pass your own data")
    chosen, total = [], 0
    for f in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        rel = f.relative_to(root).parts
        if set(rel[:-1]) & _SKIP_PARTS or not f.is_file():
            continue
        size = f.stat().st_size
        if chosen and total + size > max_bytes:
            continue  # try smaller files further on; deterministic either way
        chosen.append(f)
        total += size
    return root, chosen


def _read_stdlib(files: List[Path]) -> List[str]:
    docs = []
    for f in files:
        try:
            docs.append(f.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError):
            continue  # our own corpus, not user input: an odd file is simply left out
    return docs


def _tokenizer_sample(docs: List[str], sample_bytes: int) -> List[str]:
    """Deterministic spread-out sample for tokenizer training, as chunks of 8 lines."""
    total = sum(len(d) for d in docs) or 1
    stride = max(1, round(total / sample_bytes))
    out, size = [], 0
    for d in docs[::stride]:
        lines = d.split("\n")
        for i in range(0, len(lines), 8):
            chunk = "\n".join(lines[i : i + 8]) + "\n"
            out.append(chunk)
            size += len(chunk)
        if size >= sample_bytes:
            break
    return out


def prepare_embedded_default(
    output_dir: Union[str, Path],
    seq_len: int = 256,
    vocab_size: int = 8192,
    max_bytes: int = 12_000_000,
    num_shards: int = 1,
    overwrite: bool = False,
    progress: bool = True,
) -> Tuple[Dict, str]:
    """Build the embedded default pretraining corpus in ``output_dir``; returns (meta, summary line).

    The Python standard library's source files (this interpreter's), at most
    ``max_bytes`` of them, a byte-fallback BPE sentencepiece tokenizer of
    ``vocab_size`` trained on a ~2 MB sample (saved as ``tokenizer.model``), and
    packed ``seq_len`` windows. Same Python version and arguments -> same bytes.
    """
    start = time.time()
    _check_seq_len(seq_len)
    if not 512 <= vocab_size <= 65536:
        raise UserError(f"--vocab-size: must be between 512 and 65536, got {vocab_size}")
    if max_bytes < 10_000:
        raise UserError(f"--max-bytes: must be at least 10000, got {max_bytes}")
    root, files = stdlib_files(max_bytes)
    stats = PackStats()
    with ShardWriter(output_dir, num_shards, overwrite) as writer:
        docs = _read_stdlib(files)
        model_file = writer.tmp / "tokenizer.model"
        train_sentencepiece(_tokenizer_sample(docs, min(_SAMPLE_BYTES, max_bytes)), vocab_size, model_file)
        tok = load_tokenizer(model_file)
        _pack_pretrain(_progress(docs, progress, total=len(docs)), tok, seq_len, writer, stats)
        _check_not_empty(stats, [root], num_shards)
        meta = _meta("pretrain", seq_len, tok, "embedded-default", stats, [str(root)])
        meta["embedded_default"] = {
            "python": platform.python_version(),
            "stdlib": str(root),
            "files": len(docs),
            "max_bytes": max_bytes,
            "vocab_size": vocab_size,
            "implementation": sys.implementation.name,
        }
        meta = writer.install(meta)
    return meta, _summary(stats, writer, time.time() - start)


# --------------------------------------------------------------------------- embedded chat corpus


def stdlib_conversations(limit: int, max_chars: int = 48) -> List[Dict]:
    """Up to ``limit`` chat records from the standard library's documented functions and classes: the user names
    one, the assistant answers with the first words of its docstring (at most ``max_chars``). The answers differ
    in length, so the rows of an SFT corpus made from them hold different numbers of labelled tokens."""
    import ast

    root, files = stdlib_files(4_000_000)
    records: List[Dict] = []
    for path in files:
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
            continue  # our own corpus, not user input: an odd file is simply left out
        for node in tree.body:
            doc = ast.get_docstring(node) if isinstance(node, (ast.FunctionDef, ast.ClassDef)) else None
            if not doc or node.name.startswith("_"):
                continue
            answer = doc.strip().splitlines()[0].strip()[:max_chars]
            if len(answer) < 8:
                continue
            turns = [{"role": "user", "content": node.name}, {"role": "assistant", "content": answer}]
            records.append({"messages": turns})
            if len(records) >= limit:
                return records
    return records


def prepare_embedded_chat(
    output_dir: Union[str, Path], tokenizer: Union[str, Path], seq_len: int, conversations: int = 512
) -> Tuple[Dict, str]:
    """An SFT folder of :func:`stdlib_conversations` (prompts masked, rows of different lengths) tokenized with
    ``tokenizer``; returns (meta, summary line). It is the SFT corpus of ``plan --execute``."""
    import json
    import tempfile

    with tempfile.TemporaryDirectory(prefix="ms-deepseek-chat-") as tmp:
        source = Path(tmp) / "conversations.jsonl"
        source.write_text("".join(json.dumps(r) + "\n" for r in stdlib_conversations(conversations)))
        return prepare_data([source], output_dir, tokenizer, seq_len, fmt="sft", progress=False)
