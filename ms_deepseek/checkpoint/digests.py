"""Digests of a checkpoint's files: taken while each file is written, kept in its ``state.json``, checked
wherever a checkpoint is read (resume, export, conversion, generation).

``state.json`` holds ``"files": {"model.safetensors": {"bytes": N, "sha256": HEX}, ...}``, relative
paths (``rank_00001/model.safetensors`` in a sharded checkpoint). The tensor files are hashed as their
bytes stream to disk (:func:`ms_deepseek.checkpoint.safetensors_io.write_file`'s ``digest``): no second
read at save time. The small files (``config.json``, ``recipe.yaml``) are hashed from their text.
SHA-256 (``hashlib``, the standard library): any file can be checked by hand with ``sha256sum``.

Reading checks each recorded file once per process (size, then every byte hashed again), before its
tensors are used. ``MS_DEEPSEEK_VERIFY=size`` checks sizes only (a truncated or grown file, not a changed
byte), for huge checkpoints on slow storage; a checkpoint without ``"files"`` (written before digests
were recorded, or by hand) is read unchecked.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Dict, Iterable, Optional

from ms_deepseek.core.errors import UserError
from ms_deepseek.core.safe_io import json_loads

ALGORITHM = "sha256"
FILES_KEY = "files"  # the key of state.json that holds the digests
VERIFY_ENV = "MS_DEEPSEEK_VERIFY"  # "full" (default) or "size"
_CHUNK = 16 * 1024 * 1024
_verified: Dict[str, tuple] = {}  # real path -> (size, mtime_ns) of a file whose digest matched


def new_hasher():
    """The hash a file's bytes are fed to while it is written."""
    return hashlib.new(ALGORITHM)


def entry(nbytes: int, hasher) -> Dict:
    """What state.json records of one file."""
    return {"bytes": int(nbytes), ALGORITHM: hasher.hexdigest()}


def text_entry(text: str) -> Dict:
    data = text.encode("utf-8")
    return entry(len(data), hashlib.new(ALGORITHM, data))


def file_entry(path: Path) -> Dict:
    """A small file's entry, read from disk (config files a writer copied rather than wrote)."""
    hasher = new_hasher()
    size = _hash_file(Path(path), hasher)
    return entry(size, hasher)


def verify_mode() -> str:
    mode = os.environ.get(VERIFY_ENV, "full").strip() or "full"
    if mode not in ("full", "size"):
        raise UserError(f"{VERIFY_ENV}={mode!r}: expected full (every byte, the default) or size (sizes only)")
    return mode


def recorded(folder) -> Dict[str, Dict]:
    """The digests ``folder/state.json`` records ({} when it records none, or there is no state.json)."""
    path = Path(folder) / "state.json"
    try:
        state = json_loads(path.read_text(encoding="utf-8"), path)
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise UserError(f"{path}: unreadable ({exc})") from None
    files = state.get(FILES_KEY) if isinstance(state, dict) else None
    if files is None:
        return {}
    if not isinstance(files, dict) or not all(
        isinstance(v, dict) and isinstance(v.get("bytes"), int) and isinstance(v.get(ALGORITHM), str)
        for v in files.values()
    ):
        raise UserError(f"{path}: {FILES_KEY!r} must map each file to its bytes and {ALGORITHM}")
    return files


def check_file(folder, rel: str, files: Optional[Dict[str, Dict]] = None, mode: Optional[str] = None) -> None:
    """``folder/rel`` is the file that was saved: UserError naming it when its size or digest differs
    (``mode``: "full" or "size"; default :func:`verify_mode`)."""
    folder = Path(folder)
    files = recorded(folder) if files is None else files
    want = files.get(rel)
    if want is None:
        return
    path = folder / rel
    try:
        st = path.stat()
    except OSError as exc:
        raise UserError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if st.st_size != want["bytes"]:
        raise UserError(
            f"{path}: damaged checkpoint file ({st.st_size} bytes, {want['bytes']} when it was saved, "
            f"as {folder / 'state.json'} records)"
        )
    key = os.path.realpath(path)
    if (mode or verify_mode()) == "size" or _verified.get(key) == (st.st_size, st.st_mtime_ns):
        return
    hasher = new_hasher()
    _hash_file(path, hasher)
    if hasher.hexdigest() != want[ALGORITHM]:
        raise UserError(
            f"{path}: damaged checkpoint file (its {ALGORITHM} differs from the one {folder / 'state.json'} "
            "recorded when it was saved)"
        )
    _verified[key] = (st.st_size, st.st_mtime_ns)


def check_files(folder, names: Optional[Iterable[str]] = None, ranks_by_size: bool = False) -> None:
    """Every recorded file of ``folder`` (or those of ``names`` it records); ``ranks_by_size``: the
    ``rank_RRRRR/`` files of a sharded checkpoint by size only (each rank checks the bytes of the files it
    reads, :class:`~ms_deepseek.checkpoint.slice_readers.ShardedSource`)."""
    files = recorded(folder)
    for rel in sorted(files) if names is None else names:
        check_file(folder, rel, files, "size" if ranks_by_size and rel.startswith("rank_") else None)


def damage(folder, ranks_by_size: bool = False) -> Optional[str]:
    """The first damaged file of ``folder``, as the line that refuses it; None when the folder is intact."""
    try:
        check_files(folder, ranks_by_size=ranks_by_size)
    except UserError as exc:
        return str(exc)
    return None


def _hash_file(path: Path, hasher) -> int:
    buf = memoryview(bytearray(_CHUNK))
    size = 0
    try:
        with open(path, "rb", buffering=0) as f:
            while True:
                got = f.readinto(buf)
                if not got:
                    return size
                hasher.update(buf[:got])
                size += got
    except OSError as exc:
        raise UserError(f"{path}: cannot read ({exc.strerror or exc})") from None
