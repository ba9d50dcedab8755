"""The safetensors file format at the byte level: parse and validate headers, write headers, copy byte ranges.

A safetensors file is::

    [8 bytes: header length N, little-endian u64]
    [N bytes: JSON header, padded with spaces]   {"__metadata__": {str: str},
                                                  name: {"dtype": "BF16", "shape": [..], "data_offsets": [s, e]}, ...}
    [data: tensor bytes, offsets relative to the start of this section]

Conversion never needs tensor values, only where their bytes are, so nothing here
imports numpy or MindSpore at import time: bfloat16 is copied as bytes. Host arrays (training
checkpoints, LoRA bases, merges) are written by :func:`write_arrays`, which encodes them with
:func:`encode_array`: this module is the one safetensors writer. Headers are checked as
strictly as the reference Rust implementation (offsets contiguous from 0, sizes
matching dtype x shape, data ending exactly at the end of the file), so a file we
accept loads in ``safetensors`` and in MindSpore.
"""

from __future__ import annotations

import errno
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from ms_deepseek.core.dtypes import BY_SAFETENSORS, FLOAT_SAFETENSORS
from ms_deepseek.core.errors import UserError
from ms_deepseek.core.safe_io import json_loads

# views of the one dtype table (core.dtypes), by safetensors code
DTYPE_SIZES: Dict[str, int] = {code: d.itemsize for code, d in BY_SAFETENSORS.items()}
FLOAT_DTYPES = FLOAT_SAFETENSORS
DTYPE_NAMES = {code: BY_SAFETENSORS[code].name for code in FLOAT_SAFETENSORS}

MAX_HEADER_BYTES = 100 * 1000 * 1000  # the reference implementation's limit
_COPY_CHUNK = 64 * 1024 * 1024  # bytes per copy call (progress granularity, bounded buffer)
_FALLBACK_ERRNOS = {errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.EBADF, errno.EPERM}


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes are: ``file`` from absolute byte ``offset``, ``nbytes`` long."""

    name: str
    dtype: str
    shape: Tuple[int, ...]
    file: Path
    offset: int
    nbytes: int


@dataclass
class FileHeader:
    path: Path
    size: int
    data_start: int  # 8 + header length
    metadata: Optional[Dict[str, str]]
    tensors: Dict[str, TensorInfo]  # in data-offset order


def numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def read_header(path: Path) -> FileHeader:
    """Parse and validate ``path``'s header against the file size; UserError naming file and tensor."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise UserError(
                    f"{path}: truncated or not a safetensors file ({size} bytes; "
                    "a safetensors file starts with an 8-byte header length)"
                )
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES:
                raise UserError(f"{path}: corrupt safetensors header (header length {n} bytes is implausible)")
            if 8 + n > size:
                raise UserError(f"{path}: truncated safetensors file (header of {n} bytes, file holds {size} bytes)")
            raw = f.read(n)
    except OSError as exc:
        raise UserError(f"{path}: cannot read ({exc.strerror or exc})") from None
    try:
        header = json_loads(raw.decode("utf-8"), f"{path} (safetensors header)")
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"{path}: corrupt safetensors header (not JSON: {exc})") from None
    if not isinstance(header, dict):
        raise UserError(f"{path}: corrupt safetensors header (expected a JSON object)")
    metadata = header.pop("__metadata__", None)
    if metadata is not None and (
        not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values())
    ):
        raise UserError(f"{path}: corrupt safetensors header (__metadata__ must map strings to strings)")
    data_start = 8 + n
    data_len = size - data_start
    entries = []
    for name, info in header.items():
        entries.append(_check_entry(path, name, info))
    entries.sort(key=lambda e: (e[3], e[4]))
    expected_start = 0
    tensors: Dict[str, TensorInfo] = {}
    for name, dtype, shape, start, end in entries:
        if start != expected_start:
            what = "overlaps the previous tensor" if start < expected_start else "leaves a gap before it"
            raise UserError(f"{path}: corrupt safetensors header: tensor {name} data_offsets [{start}, {end}] {what}")
        if end > data_len:
            raise UserError(
                f"{path}: truncated safetensors file: tensor {name} needs bytes up to {data_start + end}, "
                f"the file holds {size}"
            )
        expected_start = end
        tensors[name] = TensorInfo(name, dtype, shape, path, data_start + start, end - start)
    if expected_start != data_len:
        raise UserError(f"{path}: corrupt safetensors file: {data_len - expected_start} bytes after the last tensor")
    return FileHeader(path=path, size=size, data_start=data_start, metadata=metadata, tensors=tensors)


def _check_entry(path: Path, name: str, info) -> Tuple[str, str, Tuple[int, ...], int, int]:
    bad = f"{path}: corrupt safetensors header: tensor {name}"
    if not isinstance(info, dict):
        raise UserError(f"{bad}: entry is not an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:  # a list / object is unhashable
        raise UserError(f"{bad}: unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise UserError(f"{bad}: bad shape {shape!r}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offsets)
        or offsets[1] < offsets[0]
    ):
        raise UserError(f"{bad}: bad data_offsets {offsets!r}")
    start, end = offsets
    want = numel(shape) * DTYPE_SIZES[dtype]
    if end - start != want:
        raise UserError(f"{bad}: {end - start} bytes in data_offsets, dtype {dtype} x shape {shape} needs {want}")
    return name, dtype, tuple(shape), start, end


# --------------------------------------------------------------------------- writing
@dataclass(frozen=True)
class OutTensor:
    """One tensor of an output file: its bytes are the concatenation of ``pieces`` (file, offset, nbytes),
    or, when ``produce`` is given, what it returns (an array or bytes, e.g. slices put together)."""

    name: str
    dtype: str
    shape: Tuple[int, ...]
    pieces: Tuple[Tuple[Path, int, int], ...] = ()
    produce: Optional[Callable[[], object]] = None

    @property
    def nbytes(self) -> int:
        if self.produce is not None:
            return numel(self.shape) * DTYPE_SIZES[self.dtype]
        return sum(p[2] for p in self.pieces)


def order_for_alignment(tensors: Sequence[OutTensor]) -> List[OutTensor]:
    """Wider dtypes first (stable): with an 8-byte aligned header every tensor then starts aligned to its dtype."""
    return sorted(tensors, key=lambda t: -DTYPE_SIZES[t.dtype])


def build_header(tensors: Sequence[OutTensor], metadata: Optional[Mapping[str, str]]) -> bytes:
    """The 8-byte length plus the JSON header of ``tensors`` (in this order), see :func:`header_bytes`."""
    for t in tensors:
        want = numel(t.shape) * DTYPE_SIZES[t.dtype]
        if want != t.nbytes:  # a planning bug, not user input
            raise AssertionError(f"{t.name}: {t.nbytes} bytes planned, shape {t.shape} {t.dtype} needs {want}")
    return header_bytes([(t.name, t.dtype, t.shape) for t in tensors], metadata)


def header_bytes(entries: Sequence[Tuple[str, str, Sequence[int]]], metadata: Optional[Mapping[str, str]]) -> bytes:
    """The 8-byte length plus the JSON header of (name, safetensors dtype, shape) entries stored back to
    back in this order, padded with spaces to a multiple of 8 (the one header writer).

    Entries are written in data-offset order: MindSpore's reader requires it.
    """
    header: Dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    for name, dtype, shape in entries:
        nbytes = numel(shape) * DTYPE_SIZES[dtype]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def array_tensor(name: str, array) -> OutTensor:
    """An in-memory numpy array as a tensor to write (float32 / float16 / integer; bfloat16 has no numpy dtype)."""
    import numpy as np

    array = np.ascontiguousarray(array)
    code = {"<f4": "F32", "<f2": "F16", "<f8": "F64", "<i4": "I32", "<i8": "I64", "|i1": "I8", "|u1": "U8"}.get(
        array.dtype.str
    )
    if code is None:
        raise AssertionError(f"{name}: cannot write numpy dtype {array.dtype} as a safetensors tensor")
    return OutTensor(name, code, tuple(array.shape), produce=lambda: array)


def encode_array(values, sf_dtype: str) -> bytes:
    """The bytes of a host array stored as ``sf_dtype``: floats converted (bfloat16 rounded to nearest even
    from float32), other dtypes as they are (the array's numpy dtype must already be ``sf_dtype``'s)."""
    import numpy as np

    if sf_dtype == "F32":
        return values.astype(np.float32).tobytes()
    if sf_dtype == "F16":
        return values.astype(np.float16).tobytes()
    if sf_dtype == "BF16":
        bits = values.astype(np.float32).view(np.uint32)
        rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
        return rounded.astype(np.uint16).tobytes()
    data = np.ascontiguousarray(values).tobytes()
    if len(data) != values.size * DTYPE_SIZES[sf_dtype]:
        raise AssertionError(f"cannot store a numpy {values.dtype} array as {sf_dtype}")
    return data


def write_arrays(
    path: Path,
    tensors: Mapping[str, Tuple[object, str]],
    metadata: Optional[Mapping[str, str]] = None,
    digest=None,
) -> int:
    """A safetensors file from host arrays: ``{name: (array, safetensors dtype code)}``, each encoded to
    its code by :func:`encode_array`; or ``{name: (produce, code, shape)}`` where ``produce()`` returns
    the array when the file is written (one tensor on the host at a time). Returns the file size;
    ``digest`` (a ``hashlib`` object) is fed the file's bytes as they are written (:func:`write_file`)."""
    import numpy as np

    planned = []
    for name, entry in tensors.items():
        if len(entry) == 3:
            produce, code, shape = entry
        else:
            array, code = entry
            produce, shape = (lambda a=array: a), tuple(np.shape(array))
        planned.append(
            OutTensor(
                name, code, tuple(shape), produce=lambda p=produce, c=code: encode_array(np.ascontiguousarray(p()), c)
            )
        )
    return write_file(
        path, order_for_alignment(planned), {"format": "pt"} if metadata is None else metadata, digest=digest
    )


def kernel_copy_enabled() -> bool:
    """``os.copy_file_range`` unless ``MS_DEEPSEEK_NO_COPY_FILE_RANGE=1`` (for filesystems that mishandle it)."""
    return hasattr(os, "copy_file_range") and os.environ.get("MS_DEEPSEEK_NO_COPY_FILE_RANGE", "") != "1"


def copy_range(
    src_fd: int,
    dst_fd: int,
    src_off: int,
    dst_off: int,
    count: int,
    on_bytes: Callable[[int], None],
    state: Dict[str, object],
) -> int:
    """Copy ``count`` bytes; returns how many were copied (fewer only if the source ended early).

    Uses ``os.copy_file_range`` (in-kernel, no user-space buffer) and falls back to a
    pread/pwrite loop through one reused 64 MB buffer where the kernel or filesystem
    refuses it, so memory stays bounded either way.
    """
    done = 0
    while done < count:
        step = min(_COPY_CHUNK, count - done)
        got = -1
        if state.setdefault("kernel_copy", kernel_copy_enabled()):
            try:
                got = os.copy_file_range(src_fd, dst_fd, step, src_off + done, dst_off + done)
            except OSError as exc:
                if exc.errno not in _FALLBACK_ERRNOS:
                    raise
                state["kernel_copy"] = False
        if got < 0:
            buf = state.get("buffer")
            if buf is None or len(buf) < step:  # grows to the largest step seen, at most _COPY_CHUNK
                buf = state["buffer"] = memoryview(bytearray(step))
            got = os.preadv(src_fd, [buf[:step]], src_off + done)
            if state.get("digest") is not None:
                state["digest"].update(buf[:got])
            written = 0
            while written < got:
                written += os.pwrite(dst_fd, buf[written:got], dst_off + done + written)
        if got == 0:
            return done
        done += got
        on_bytes(got)
    return done


def write_file(
    path: Path,
    tensors: Sequence[OutTensor],
    metadata: Optional[Mapping[str, str]],
    on_bytes: Callable[[int], None] = lambda n: None,
    fsync: bool = True,
    digest=None,
) -> int:
    """Write one safetensors file from byte ranges of other files; returns the file size.

    ``digest`` (a ``hashlib`` object) is fed every byte in file order as it is written, so a checkpoint's
    digest costs no second read (:mod:`ms_deepseek.checkpoint.digests`); byte ranges then go through the
    user-space buffer, which the hash must see, instead of ``copy_file_range``."""
    header = build_header(tensors, metadata)
    state: Dict[str, object] = {} if digest is None else {"digest": digest, "kernel_copy": False}
    fds: Dict[Path, int] = {}
    out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _write_all(out, header, 0)
        if digest is not None:
            digest.update(header)
        pos = len(header)
        for t in tensors:
            if t.produce is not None:
                data = memoryview(t.produce()).cast("B")  # bytes of an array, in C order
                if len(data) != t.nbytes:
                    raise AssertionError(f"{t.name}: produced {len(data)} bytes, expected {t.nbytes}")
                _write_all(out, data, pos)
                if digest is not None:
                    digest.update(data)
                on_bytes(len(data))
                pos += len(data)
                continue
            for src, src_off, nbytes in t.pieces:
                if src not in fds:
                    try:
                        fds[src] = os.open(src, os.O_RDONLY)
                    except OSError as exc:
                        raise UserError(f"{src}: cannot open ({exc.strerror or exc})") from None
                got = copy_range(fds[src], out, src_off, pos, nbytes, on_bytes, state)
                if got != nbytes:
                    raise UserError(f"{src}: tensor {t.name} ends early (file shrank while converting?)")
                pos += nbytes
        os.ftruncate(out, pos)
        if fsync:
            os.fsync(out)
        return pos
    finally:
        os.close(out)
        for fd in fds.values():
            os.close(fd)


def _write_all(fd: int, data, pos: int) -> None:
    """``data`` at ``pos``, however many calls it takes."""
    written = 0
    while written < len(data):
        written += os.pwrite(fd, data[written:], pos + written)
