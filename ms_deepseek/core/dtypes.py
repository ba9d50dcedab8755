"""The one dtype table: our names (config.json's ``torch_dtype``, recipes), safetensors codes, sizes,
the numpy dtype of the stored bits, and MindSpore's dtype.

bfloat16 has no numpy dtype: its bits are read and written as ``uint16`` (the top half of a
float32, widened exactly by :func:`ms_deepseek.checkpoint.slice_readers.to_float32`). Importing this
module does not import MindSpore; :func:`ms_dtype` does, on first use.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Tuple


@dataclass(frozen=True)
class DType:
    name: str  # ours / config.json's: "bfloat16"
    safetensors: str  # the safetensors header's code: "BF16"
    itemsize: int  # bytes per element
    raw: str  # numpy dtype of the stored bits (little-endian): "<u2" for bfloat16


TABLE: Tuple[DType, ...] = (
    DType("float32", "F32", 4, "<f4"),
    DType("float16", "F16", 2, "<f2"),
    DType("bfloat16", "BF16", 2, "<u2"),
    DType("float64", "F64", 8, "<f8"),
    DType("int64", "I64", 8, "<i8"),
    DType("int32", "I32", 4, "<i4"),
    DType("int16", "I16", 2, "<i2"),
    DType("int8", "I8", 1, "i1"),
    DType("uint64", "U64", 8, "<u8"),
    DType("uint32", "U32", 4, "<u4"),
    DType("uint16", "U16", 2, "<u2"),
    DType("uint8", "U8", 1, "u1"),
    DType("bool", "BOOL", 1, "u1"),
    DType("float8_e4m3fn", "F8_E4M3", 1, "u1"),
    DType("float8_e5m2", "F8_E5M2", 1, "u1"),
)
BY_NAME: Dict[str, DType] = {d.name: d for d in TABLE}
BY_SAFETENSORS: Dict[str, DType] = {d.safetensors: d for d in TABLE}

# the floating dtypes a model computes and stores its weights in
FLOAT_NAMES = ("float32", "float16", "bfloat16")
FLOAT_SAFETENSORS = tuple(BY_NAME[n].safetensors for n in FLOAT_NAMES)


def safetensors_code(name: str) -> str:
    """ "bfloat16" -> "BF16"."""
    return BY_NAME[name].safetensors


def itemsize(dtype: str) -> int:
    """Bytes per element of a dtype given by our name or its safetensors code."""
    return (BY_NAME.get(dtype) or BY_SAFETENSORS[dtype]).itemsize


def raw_numpy(code: str) -> str:
    """The numpy dtype that holds a safetensors dtype's stored bits ("BF16" -> "<u2")."""
    return BY_SAFETENSORS[code].raw


def ms_dtype(name: str):
    """MindSpore's dtype for one of :data:`FLOAT_NAMES` (or int32 / int64 / bool)."""
    import mindspore as ms

    return getattr(ms, "bool_" if name == "bool" else name)
