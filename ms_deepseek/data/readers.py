"""Corpus readers: jsonl, parquet and plain text files -> documents.

A pretraining document is a string. An SFT document is a conversation: a list
of ``{"role": "system" | "user" | "assistant", "content": str}`` messages.

Accepted records (jsonl lines, parquet rows):

* pretraining: ``{"text": "..."}``
* SFT: ``{"messages": [{"role": ..., "content": ...}, ...]}`` or
  ``{"prompt": "...", "response": "..."}`` (optional ``"system": "..."``)

Plain text files (any suffix other than .jsonl / .parquet) are one pretraining
document each. Every problem (missing file, bad JSON, bad parquet, non-UTF-8
bytes, missing field) is a UserError naming the file and line or row.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator, List, Sequence, Tuple, Union

from ms_deepseek.core.errors import UserError
from ms_deepseek.core.safe_io import json_loads, regular_file

JSONL_SUFFIXES = (".jsonl",)
PARQUET_SUFFIXES = (".parquet",)
ROLES = ("system", "user", "assistant")
_SKIP_DIRS = {"__pycache__", ".git", ".hg", ".svn"}

Document = Union[str, List[dict]]


def discover_files(inputs: Sequence[Union[str, Path]]) -> List[Path]:
    """Files named by ``inputs``, in the order given; folders are walked recursively
    in sorted path order, skipping hidden entries and ``__pycache__``."""
    files: List[Path] = []
    for item in inputs:
        p = Path(item).expanduser()
        if p.is_file():
            files.append(p)
        elif p.is_dir():
            for f in sorted(p.rglob("*"), key=lambda x: x.relative_to(p).as_posix()):
                rel = f.relative_to(p).parts
                if any(part.startswith(".") or part in _SKIP_DIRS for part in rel):
                    continue
                if f.is_file():
                    files.append(f)
        elif p.exists():
            regular_file(p, "input file")  # a FIFO, socket or device: refused with what it is
        else:
            raise UserError(f"{p}: no such file or folder")
    if not files:
        raise UserError(f"{', '.join(str(i) for i in inputs)}: no input files found")
    return files


def file_kind(path: Path) -> str:
    name = path.name.lower()
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(PARQUET_SUFFIXES):
        return "parquet"
    return "text"


def _utf8_error(path: Path, data: bytes, exc: UnicodeDecodeError, line_offset: int = 0) -> UserError:
    line = data.count(b"\n", 0, exc.start) + 1 + line_offset
    return UserError(f"{path}:{line}: not valid UTF-8 (byte 0x{data[exc.start]:02x})")


def _text(where: str, value: Any, key: str) -> str:
    if not isinstance(value, str):
        raise UserError(f"{where}: {key!r} must be a string, got {type(value).__name__}")
    try:  # JSON may escape a lone surrogate ("\ud800"): not text any tokenizer can take
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise UserError(
            f"{where}: {key!r} holds a lone surrogate (U+{ord(value[exc.start]):04X}) at character "
            f"{exc.start}; not valid Unicode text"
        ) from None
    return value


def _conversation(where: str, record: Any) -> List[dict]:
    """An SFT record -> list of {"role", "content"} messages (validated)."""
    if not isinstance(record, dict):
        raise UserError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if record.get("messages") is not None:
        raw = record["messages"]
        if not isinstance(raw, list) or not raw:
            raise UserError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
        messages = []
        for i, m in enumerate(raw):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise UserError(f"{where}: messages[{i}] must be an object with 'role' and 'content'")
            role = m["role"]
            if role not in ROLES:
                raise UserError(f"{where}: messages[{i}].role {role!r} is not one of {', '.join(ROLES)}")
            messages.append({"role": role, "content": _text(where, m["content"], f"messages[{i}].content")})
        return messages
    if record.get("prompt") is not None or record.get("response") is not None:
        if record.get("prompt") is None or record.get("response") is None:
            raise UserError(f"{where}: a prompt/response record needs both 'prompt' and 'response'")
        messages = []
        if record.get("system") is not None:
            messages.append({"role": "system", "content": _text(where, record["system"], "system")})
        messages.append({"role": "user", "content": _text(where, record["prompt"], "prompt")})
        messages.append({"role": "assistant", "content": _text(where, record["response"], "response")})
        return messages
    raise UserError(
        f"{where}: SFT records need 'messages' or 'prompt' and 'response' "
        f"(keys found: {', '.join(sorted(record)) or 'none'})"
    )


def _pretrain_text(where: str, record: Any) -> str:
    if not isinstance(record, dict):
        raise UserError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if "text" not in record:
        raise UserError(
            f"{where}: no 'text' field (pretraining records are {{\"text\": ...}}; "
            f"keys found: {', '.join(sorted(record)) or 'none'})"
        )
    return _text(where, record["text"], "text")


def _record_to_doc(where: str, record: Any, fmt: str) -> Document:
    return _pretrain_text(where, record) if fmt == "pretrain" else _conversation(where, record)


def read_jsonl(path: Path, fmt: str) -> Iterator[Tuple[str, Document]]:
    try:
        fh = path.open("rb")
    except OSError as exc:
        raise UserError(f"{path}: cannot read ({exc.strerror})") from None
    with fh:
        for lineno, raw in enumerate(fh, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise _utf8_error(path, raw, exc, lineno - 1) from None
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                record = json_loads(line, where)
            except json.JSONDecodeError as exc:
                raise UserError(f"{where}: bad JSON ({exc.msg} at column {exc.colno})") from None
            yield where, _record_to_doc(where, record, fmt)


def read_parquet(path: Path, fmt: str) -> Iterator[Tuple[str, Document]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(str(path))
    except (OSError, pa.ArrowException) as exc:
        raise UserError(f"{path}: not a readable parquet file ({str(exc).splitlines()[0][:200]})") from None
    names = set(pf.schema_arrow.names)
    found = ", ".join(sorted(names)) or "none"
    if fmt == "pretrain":
        if "text" not in names:
            raise UserError(f"{path}: no 'text' column (columns: {found})")
        columns = ["text"]
    elif "messages" in names:
        columns = ["messages"]
    elif {"prompt", "response"} <= names:
        columns = [c for c in ("system", "prompt", "response") if c in names]
    else:
        raise UserError(
            f"{path}: SFT parquet needs a 'messages' column or 'prompt' and 'response' columns (columns: {found})"
        )
    row = 0
    try:
        for batch in pf.iter_batches(batch_size=1024, columns=columns):
            for record in batch.to_pylist():
                row += 1
                where = f"{path}: row {row}"
                yield where, _record_to_doc(where, record, fmt)
    except (OSError, pa.ArrowException) as exc:
        raise UserError(f"{path}: row {row + 1}: unreadable ({str(exc).splitlines()[0][:200]})") from None


def read_text_file(path: Path) -> str:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise UserError(f"{path}: cannot read ({exc.strerror})") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _utf8_error(path, data, exc) from None


def iter_documents(files: Sequence[Path], fmt: str) -> Iterator[Tuple[str, Document]]:
    """Yield ``(where, document)`` for every record of every file, in order."""
    for path in files:
        kind = file_kind(path)
        if kind == "jsonl":
            yield from read_jsonl(path, fmt)
        elif kind == "parquet":
            yield from read_parquet(path, fmt)
        elif fmt == "sft":
            raise UserError(
                f"{path}: plain text files are pretraining documents; "
                "--format sft reads .jsonl or .parquet conversations"
            )
        else:
            yield str(path), read_text_file(path)
