"""Check a source checkpoint against its config and map the output: which bytes go where.

A byte map is a list of output shards, each a list of :class:`OutTensor` whose bytes are
byte ranges of the source files:

* hf -> ms: a stacked expert tensor [E, out, in] is the E per-expert tensors back to
  back (expert e at index e), every other tensor is one range, renamed 1:1;
* ms -> hf: the reverse, a stacked tensor split into E equal ranges.

No tensor value is read, so the dtype is whatever the source holds (bfloat16 stays
bfloat16) and the output is byte-identical to the input, only regrouped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from ms_deepseek.checkpoint.safetensors_io import DTYPE_SIZES, FLOAT_DTYPES, OutTensor, TensorInfo, order_for_alignment
from ms_deepseek.checkpoint.weight_files import WeightFiles
from ms_deepseek.config import names
from ms_deepseek.config.inventory import expected_hf_shapes, expected_ms_shapes, ms_buffer_shapes, zero_width_shapes
from ms_deepseek.config.names import layer_key
from ms_deepseek.core.errors import UserError


@dataclass
class ByteMap:
    shards: List[List[OutTensor]]  # each already in on-disk order
    total_bytes: int
    dtype: str  # the dtype holding most bytes ("BF16", ...), for config.json's torch_dtype

    @property
    def num_tensors(self) -> int:
        return sum(len(s) for s in self.shards)


def _fmt(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def check_tensors(
    ckpt: WeightFiles,
    expected: Dict[str, Tuple[int, ...]],
    layout: str,
    optional: Optional[Dict[str, Tuple[int, ...]]] = None,
) -> None:
    """Names, shapes and dtypes of ``ckpt`` against ``expected``; UserError naming file and tensor.

    ``optional`` names non-weight tensors that may be present (shape checked, any dtype).
    """
    cfg_file = ckpt.config_path.name
    optional = optional or {}
    for name, shape in optional.items():
        info = ckpt.tensors.get(name)
        if info is not None and info.shape != shape:
            raise UserError(
                f"{info.file}: tensor {name} has shape {_fmt(info.shape)}, {ckpt.config_path} implies {_fmt(shape)}"
            )
    unexpected = [n for n in ckpt.tensors if n not in expected and n not in optional]
    if unexpected:
        unexpected.sort(key=lambda n: (layer_key(n), n))
        name = unexpected[0]
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        hint = ""
        if layout == "HuggingFace" and names.is_stacked_expert(name):
            hint = "; this looks like an ms_deepseek checkpoint: use ms-to-hf"
        elif layout == "ms_deepseek" and names.hf_to_ms(name)[1] is not None:
            hint = "; this looks like a HuggingFace checkpoint: use hf-to-ms"
        raise UserError(
            f"{ckpt.where(name)}: unexpected tensor {name}{more} (not in the {layout} layout that "
            f"{ckpt.config_path} describes{hint})"
        )
    missing = [n for n in expected if n not in ckpt.tensors]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        where = ckpt.index_path or ckpt.files[0]
        raise UserError(f"{where}: missing tensor {missing[0]}{more} (required by {cfg_file} in the {layout} layout)")
    for name, shape in expected.items():
        info = ckpt.tensors[name]
        if info.shape != shape:
            raise UserError(
                f"{info.file}: tensor {name} has shape {_fmt(info.shape)}, {ckpt.config_path} implies {_fmt(shape)}"
            )
        if info.dtype not in FLOAT_DTYPES:
            raise UserError(
                f"{info.file}: tensor {name} has dtype {info.dtype}; weights must be one of {', '.join(FLOAT_DTYPES)}"
            )


def _carry_zero_width(ckpt: WeightFiles, out: List[OutTensor]) -> List[OutTensor]:
    """Zero-width tensors present in the source go to the output too (a byte-exact round trip), in layer order."""
    for name in zero_width_shapes(ckpt.config):
        info = ckpt.tensors.get(name)
        if info is not None:
            out.append(OutTensor(name, info.dtype, info.shape, ((info.file, info.offset, 0),)))
    return sorted(out, key=lambda t: layer_key(t.name))  # stable: model order within a layer is kept


def map_hf_to_ms(ckpt: WeightFiles) -> List[OutTensor]:
    cfg = ckpt.config
    check_tensors(ckpt, expected_hf_shapes(cfg), "HuggingFace", optional=zero_width_shapes(cfg))
    out: List[OutTensor] = []
    for name, shape in expected_ms_shapes(cfg).items():
        if not names.is_stacked_expert(name):
            info = ckpt.tensors[name]
            out.append(OutTensor(name, info.dtype, shape, ((info.file, info.offset, info.nbytes),)))
            continue
        parts: List[TensorInfo] = [ckpt.tensors[hf] for hf in names.ms_to_hf(name, cfg.n_routed_experts)]
        first = parts[0]
        for part in parts:
            if part.dtype != first.dtype:
                raise UserError(
                    f"{part.file}: tensor {part.name} is {part.dtype} but {first.name} "
                    f"({first.file.name}) is {first.dtype}: the experts of one layer must share a dtype"
                )
        out.append(OutTensor(name, first.dtype, shape, tuple((p.file, p.offset, p.nbytes) for p in parts)))
    return _carry_zero_width(ckpt, out)


def map_ms_to_hf(ckpt: WeightFiles) -> List[OutTensor]:
    cfg = ckpt.config
    optional = {**zero_width_shapes(cfg), **ms_buffer_shapes(cfg)}  # zero-width carried, buffers dropped
    check_tensors(ckpt, expected_ms_shapes(cfg), "ms_deepseek", optional=optional)
    out: List[OutTensor] = []
    for name in expected_ms_shapes(cfg):
        info = ckpt.tensors[name]
        if not names.is_stacked_expert(name):
            out.append(OutTensor(name, info.dtype, info.shape, ((info.file, info.offset, info.nbytes),)))
            continue
        E = cfg.n_routed_experts
        per = info.nbytes // E  # [E, out, in] -> E x [out, in], expert e at byte e * per
        for e, hf_name in enumerate(names.ms_to_hf(name, E)):
            out.append(OutTensor(hf_name, info.dtype, info.shape[1:], ((info.file, info.offset + e * per, per),)))
    return _carry_zero_width(ckpt, out)


def shard(tensors: Sequence[OutTensor], shard_size: int) -> ByteMap:
    """Cut the model-ordered tensors into files of at most ``shard_size`` bytes (a bigger tensor gets its own)."""
    shards: List[List[OutTensor]] = []
    current: List[OutTensor] = []
    size = 0
    by_dtype: Dict[str, int] = {}
    for t in tensors:
        if current and size + t.nbytes > shard_size:
            shards.append(current)
            current, size = [], 0
        current.append(t)
        size += t.nbytes
        by_dtype[t.dtype] = by_dtype.get(t.dtype, 0) + t.nbytes
    if current:
        shards.append(current)
    dtype = max(by_dtype, key=lambda d: (by_dtype[d], DTYPE_SIZES[d]))
    return ByteMap(shards=[order_for_alignment(s) for s in shards], total_bytes=sum(by_dtype.values()), dtype=dtype)
