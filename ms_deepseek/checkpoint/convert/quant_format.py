"""The quantized checkpoint format (``convert quantize``, docs/lora.md): names, arithmetic, metadata, checks.

Which tensors: the weights of every Linear a LoRA adapter can target (MLA projections, dense
MLP, shared experts) and the routed experts (per expert in the HF layout, stacked [E, out, in]
in ours). Embeddings, norms, the routers (``mlp.gate``) and ``lm_head`` keep their dtype.

Format, per quantized weight ``W`` [..., out, in] (names as Ascend msModelSlim's W8A16 output):

* ``<name>.weight``: bits 8: ``I8`` [..., out, in]; bits 4: ``U8`` [..., out, in/2], two signed
  4-bit values per byte, column 2j in the low nibble, 2j+1 in the high one (two's complement);
* ``<name>.weight_scale``: ``F32`` [..., out, in/G] (G = group size; per output channel G = in,
  so [..., out, 1] as msModelSlim's per-channel scale);
* ``<name>.weight_offset``: ``F32``, same shape, zeros (symmetric quantization; kept for the
  msModelSlim names: ANTIQUANT(w) = (w + offset) * scale);
* ``config.json`` gains ``quantization_config`` ({quant_method: ms_deepseek, bits, group_size,
  symmetric, original}); ``quant_model_description.json`` lists each tensor's kind as msModelSlim does.

Symmetric: ``scale = max|W_group| / qmax`` (qmax 127 or 7; an all-zero group gets scale 1),
``q = clip(rint(W / scale), -qmax, qmax)``; dequantised ``q * scale`` in float32 is within
``scale / 2`` of W per element.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np

from ms_deepseek.config.lora import LORA_TARGETS
from ms_deepseek.config.quant import QuantSpec
from ms_deepseek.core.errors import UserError

QUANT_METHOD = "ms_deepseek"
DESCRIPTION_FILE = "quant_model_description.json"
SUFFIXES = ("weight", "weight_scale", "weight_offset")


# ------------------------------------------------------------------------------ names
def is_quantized_weight(name: str) -> bool:
    """A weight ``convert quantize`` quantizes (HF or stacked names); lm_head, the router and the rest stay."""
    parts = name.split(".")
    return len(parts) >= 2 and parts[-1] == "weight" and parts[-2] in LORA_TARGETS and name.startswith("model.")


def quantized_entries(name: str, shape: Tuple[int, ...], spec: QuantSpec) -> List[Tuple[str, str, Tuple[int, ...]]]:
    """(name, dtype, shape) of the tensors that stand for the float weight ``name`` [..., out, in]."""
    *lead, out_f, in_f = shape
    groups = in_f // group_of(spec, in_f)
    stem = name[: -len(".weight")]
    q_shape = tuple(lead) + (out_f, in_f if spec.bits == 8 else in_f // 2)
    s_shape = tuple(lead) + (out_f, groups)
    return [
        (f"{stem}.weight", "I8" if spec.bits == 8 else "U8", q_shape),
        (f"{stem}.weight_scale", "F32", s_shape),
        (f"{stem}.weight_offset", "F32", s_shape),
    ]


def group_of(spec: QuantSpec, in_features: int) -> int:
    return spec.group_size or in_features


def check_groups(shapes: Dict[str, Tuple[int, ...]], spec: QuantSpec, what: str) -> None:
    """UserError naming the first weight whose input width the group size (or int4's pairing) does not divide."""
    for name, shape in shapes.items():
        if not is_quantized_weight(name) or 0 in shape:
            continue
        in_f = shape[-1]
        if spec.group_size is not None and in_f % spec.group_size:
            raise UserError(f"{what}: group size {spec.group_size} does not divide the input width {in_f} of {name}")
        if spec.bits == 4 and group_of(spec, in_f) % 2:
            raise UserError(f"{what}: int4 packs two values per byte; {name} has an odd input width {in_f}")


# ------------------------------------------------------------------------------ arithmetic
def quantize_array(w: np.ndarray, bits: int, group_size: Optional[int]) -> Tuple[np.ndarray, np.ndarray]:
    """w [..., out, in] float -> (q int8 [..., out, in] in [-qmax, qmax], scale float32 [..., out, in/G])."""
    w = np.asarray(w, np.float32)
    *lead, out_f, in_f = w.shape
    g = group_size or in_f
    qmax = 127.0 if bits == 8 else 7.0
    grouped = w.reshape(tuple(lead) + (out_f, in_f // g, g))  # [..., out, in] -> [..., out, in/G, G]
    scale = (np.abs(grouped).max(axis=-1) / np.float32(qmax)).astype(np.float32)  # [..., out, in/G]
    scale[scale == 0] = 1.0
    # the division in float64: q is the nearest integer to W / scale, not to its float32 rounding
    q = np.clip(np.rint(grouped.astype(np.float64) / scale[..., None]), -qmax, qmax).astype(np.int8)
    return q.reshape(w.shape), scale


def pack_int4(q: np.ndarray) -> np.ndarray:
    """int8 [..., in] in [-8, 7] -> uint8 [..., in/2]: column 2j in the low nibble, 2j+1 in the high one."""
    u = q.astype(np.uint8) & np.uint8(0x0F)
    return (u[..., 0::2] | (u[..., 1::2] << np.uint8(4))).astype(np.uint8)


def unpack_int4(p: np.ndarray) -> np.ndarray:
    """uint8 [..., in/2] -> int8 [..., in] (sign-extended nibbles), the inverse of :func:`pack_int4`."""
    p = np.asarray(p, np.uint8)
    lo = (p & np.uint8(0x0F)).astype(np.int16)
    hi = (p >> np.uint8(4)).astype(np.int16)
    both = np.stack([lo, hi], axis=-1).reshape(p.shape[:-1] + (p.shape[-1] * 2,))  # interleave
    return np.where(both >= 8, both - 16, both).astype(np.int8)


def dequantize_array(stored: np.ndarray, scale: np.ndarray, bits: int) -> np.ndarray:
    """The float32 weight of a stored (int8 or packed int4) weight and its scale (the CPU layers' arithmetic)."""
    q = np.asarray(stored, np.int8) if bits == 8 else unpack_int4(stored)
    *lead, out_f, in_f = q.shape
    groups = scale.shape[-1]
    grouped = q.astype(np.float32).reshape(tuple(lead) + (out_f, groups, in_f // groups))
    return (grouped * scale.astype(np.float32)[..., None]).reshape(q.shape)


def stored_array(w: np.ndarray, spec: QuantSpec) -> Tuple[np.ndarray, np.ndarray]:
    """(stored weight as written: int8 or packed uint8, scale) of a float weight."""
    q, scale = quantize_array(w, spec.bits, spec.group_size)
    return (q if spec.bits == 8 else pack_int4(q)), scale


# ------------------------------------------------------------------------------ checkpoint metadata
def read_quant_config(folder: Path) -> Optional[Tuple[QuantSpec, Dict]]:
    """(spec, the raw quantization_config) of a quantized checkpoint folder, None for a float one."""
    path = Path(folder) / "config.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # the config reader names a broken config.json
    section = raw.get("quantization_config") if isinstance(raw, dict) else None
    if section is None:
        return None
    if not isinstance(section, dict) or section.get("quant_method") != QUANT_METHOD:
        method = section.get("quant_method") if isinstance(section, dict) else section
        raise UserError(
            f"{path}: quantization_config.quant_method {method!r} is not supported (only checkpoints "
            f"written by `ms-deepseek convert quantize`, quant_method {QUANT_METHOD!r})"
        )
    try:
        spec = QuantSpec(bits=section.get("bits"), group_size=section.get("group_size"))
    except UserError as exc:
        raise UserError(f"{path}: quantization_config: {exc}") from None
    return spec, section


def quant_spec_of(folder: Path) -> Optional[QuantSpec]:
    """The QuantSpec a `convert quantize` folder was written with, None for a float checkpoint."""
    found = read_quant_config(folder)
    return None if found is None else found[0]


def expected_quantized(expected: Dict[str, Tuple[int, ...]], spec: QuantSpec) -> Dict[str, Tuple[Tuple[int, ...], str]]:
    """name -> (shape, dtype or None for any float) of a quantized checkpoint, from the float layout."""
    out: Dict[str, Tuple[Tuple[int, ...], Optional[str]]] = {}
    for name, shape in expected.items():
        if is_quantized_weight(name) and 0 not in shape:
            for q_name, dtype, q_shape in quantized_entries(name, tuple(shape), spec):
                out[q_name] = (q_shape, dtype)
        else:
            out[name] = (tuple(shape), None)
    return out


def check_quantized(weights, expected: Dict[str, Tuple[int, ...]], spec: QuantSpec, optional=()) -> None:
    """Names, shapes and dtypes of a quantized checkpoint; UserError naming the file and tensor."""
    from ms_deepseek.checkpoint.safetensors_io import FLOAT_DTYPES

    want = expected_quantized(expected, spec)
    for name, info in weights.tensors.items():
        if name not in want and name not in optional:
            raise UserError(
                f"{info.file}: unexpected tensor {name} (not in the quantized layout {weights.config_path} describes)"
            )
    for name, (shape, dtype) in want.items():
        info = weights.tensors.get(name)
        if info is None:
            raise UserError(
                f"{weights.index_path or weights.files[0]}: missing tensor {name} (a quantized checkpoint "
                f"with bits {spec.bits}, group_size {spec.group_size})"
            )
        if tuple(info.shape) != shape:
            raise UserError(f"{info.file}: tensor {name} has shape {list(info.shape)}, expected {list(shape)}")
        if (dtype is not None and info.dtype != dtype) or (dtype is None and info.dtype not in FLOAT_DTYPES):
            raise UserError(f"{info.file}: tensor {name} has dtype {info.dtype}, expected {dtype or 'a float dtype'}")
