"""``convert quantize``: a frozen base for QLoRA, weight-only int8 / int4 with scales.

The format (names, packing, scales) is :mod:`ms_deepseek.checkpoint.convert.quant_format`'s, documented
in ``docs/lora.md``. The source is read one tensor at a time (each quantized weight is read twice:
once for its scale, once for its values, since a file stores wider dtypes first), so memory stays
at one tensor whatever the model size; the destination appears only once complete.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np

from ms_deepseek.checkpoint.convert.quant_format import (
    DESCRIPTION_FILE,
    QUANT_METHOD,
    check_groups,
    is_quantized_weight,
    quantized_entries,
    read_quant_config,
    stored_array,
)
from ms_deepseek.config.quant import QuantSpec
from ms_deepseek.core.errors import UserError


# ------------------------------------------------------------------------------ the converter
def quantize_checkpoint(
    src,
    dst,
    bits: int,
    group_size: Optional[int] = None,
    *,
    shard_size="5GB",
    overwrite: bool = False,
    progress: bool = True,
    fsync: bool = True,
):
    """Quantize an HF or ms_deepseek folder into ``dst`` (same layout), one tensor in memory at a time."""
    from tqdm import tqdm

    from ms_deepseek.checkpoint.convert.hf import ConvertResult, parse_size
    from ms_deepseek.checkpoint.safetensors_io import order_for_alignment, write_file
    from ms_deepseek.checkpoint.weight_files import INDEX_NAME
    from ms_deepseek.core.atomic import atomic_folder, check_destination

    start = time.perf_counter()
    src, dst = Path(src), Path(dst)
    size = parse_size(shard_size)
    spec = QuantSpec(bits=bits, group_size=group_size)
    opened = _float_source(src)
    weights = opened.weights
    check_groups({n: i.shape for n, i in weights.tensors.items()}, spec, "--group-size")
    check_destination(src, dst, overwrite)

    outputs, kinds = _output_tensors(opened, spec)
    shards = _cut(outputs, size)
    n = len(shards)
    names = [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)] if n > 1 else ["model.safetensors"]
    total = sum(t.nbytes for t in outputs)
    with atomic_folder(dst, fsync=fsync) as tmp:
        with tqdm(
            total=total,
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            desc="quantize",
            disable=not progress or not os.isatty(2),
            dynamic_ncols=True,
        ) as bar:
            for name, shard in zip(names, shards):
                write_file(tmp / name, order_for_alignment(shard), {"format": "pt"}, on_bytes=bar.update, fsync=fsync)
        if n > 1:
            weight_map = {t.name: name for name, shard in zip(names, shards) for t in shard}
            (tmp / INDEX_NAME).write_text(
                json.dumps(
                    {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2
                )
                + "\n"
            )
        _write_metadata(tmp, opened, src, spec, kinds)
    return ConvertResult(
        dst=dst, files=names, num_tensors=len(outputs), total_bytes=total, seconds=time.perf_counter() - start
    )


def _output_tensors(opened, spec: QuantSpec):
    """The output tensors in source order (each quantized weight as its stored weight, scale and offset, the
    rest copied), and every tensor's kind for the metadata."""
    from ms_deepseek.checkpoint.safetensors_io import OutTensor
    from ms_deepseek.checkpoint.slice_readers import full_slice, to_float32

    def read(info):
        return to_float32(opened.model.read(info.name, full_slice(info.shape)), info.dtype)

    outputs: List[OutTensor] = []
    kinds: Dict[str, str] = {"model_quant_type": f"W{spec.bits}A16"}
    for info in sorted(opened.weights.tensors.values(), key=lambda i: (str(i.file), i.offset)):
        if is_quantized_weight(info.name) and 0 not in info.shape:
            entries = quantized_entries(info.name, info.shape, spec)
            (q_name, q_dtype, q_shape), (s_name, _, s_shape), (o_name, _, _) = entries
            # The weight and its scale are produced separately (the file orders wide dtypes first), each
            # from one read of the source tensor: memory holds one tensor, not a shard.
            outputs.append(OutTensor(q_name, q_dtype, q_shape, produce=lambda i=info: stored_array(read(i), spec)[0]))
            outputs.append(OutTensor(s_name, "F32", s_shape, produce=lambda i=info: stored_array(read(i), spec)[1]))
            outputs.append(OutTensor(o_name, "F32", s_shape, produce=lambda s=s_shape: np.zeros(s, np.float32)))
            kinds.update(
                {
                    q_name: kinds["model_quant_type"],
                    s_name: kinds["model_quant_type"],
                    o_name: kinds["model_quant_type"],
                }
            )
        else:
            outputs.append(
                OutTensor(info.name, info.dtype, tuple(info.shape), ((info.file, info.offset, info.nbytes),))
            )
            kinds[info.name] = "FLOAT"
    return outputs, kinds


def _cut(outputs, size: int):
    """The tensors in order, a new file whenever the next would take this one over ``size`` bytes."""
    shards = [[]]
    used = 0
    for t in outputs:
        if shards[-1] and used + t.nbytes > size:
            shards.append([])
            used = 0
        shards[-1].append(t)
        used += t.nbytes
    return shards


def _write_metadata(tmp: Path, opened, src: Path, spec: QuantSpec, kinds: Dict[str, str]) -> None:
    """config.json with quantization_config, the msModelSlim-style description, the carried files."""
    from ms_deepseek.checkpoint.convert.hf import CARRIED_FILES

    config = json.loads(opened.config_path.read_text(encoding="utf-8"))
    config["quantization_config"] = {
        "quant_method": QUANT_METHOD,
        "bits": spec.bits,
        "group_size": spec.group_size,
        "symmetric": True,
        "original": str(src.resolve()),
    }
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (tmp / DESCRIPTION_FILE).write_text(json.dumps(kinds, indent=2) + "\n")
    for extra in CARRIED_FILES:
        if (src / extra).is_file():
            shutil.copyfile(src / extra, tmp / extra)


# ------------------------------------------------------------------------------ pre-sharded output
class QuantizedView:
    """A float source (checkpoint/slice_readers.py) read as its quantized checkpoint, slice by slice.

    A slice of a stored weight or of its scale / offset is computed from the float weight's rows that
    hold it (the slice's leading and ``out`` ranges, the whole input width): every scale group lies in
    one row, so the values are those :func:`quantize_checkpoint` writes, whatever the split of ``in``,
    and memory stays at one tensor."""

    def __init__(self, src, cfg, spec: QuantSpec):
        from ms_deepseek.checkpoint.layout import checkpoint_inventory

        self.src, self.spec = src, spec
        self.float_of: Dict[str, tuple] = {}  # quantized name -> (float name, float shape, index in entries)
        for info in checkpoint_inventory(cfg):
            if is_quantized_weight(info.name) and 0 not in info.shape:
                for k, (q_name, _, _) in enumerate(quantized_entries(info.name, info.shape, spec)):
                    self.float_of[q_name] = (info.name, tuple(info.shape), k)

    def has(self, name: str) -> bool:
        return name in self.float_of or self.src.has(name)

    def dtype(self, name: str) -> str:
        if name in self.float_of:
            return ("I8" if self.spec.bits == 8 else "U8") if self.float_of[name][2] == 0 else "F32"
        return self.src.dtype(name)

    def read(self, name: str, sl) -> np.ndarray:
        from ms_deepseek.checkpoint.slice_readers import to_float32

        if name not in self.float_of:
            return self.src.read(name, sl)
        float_name, shape, k = self.float_of[name]
        rows = tuple(sl[:-1]) + ((0, shape[-1]),)  # the whole input width of the slice's rows
        w = to_float32(self.src.read(float_name, rows), self.src.dtype(float_name))
        stored, scale = stored_array(w, self.spec)
        value = (stored, scale, np.zeros_like(scale))[k]
        lo, hi = sl[-1]
        return np.ascontiguousarray(value[..., lo:hi])


def quantize_sharded(
    src,
    dst,
    bits: int,
    group_size: Optional[int],
    parallel,
    *,
    overwrite: bool = False,
    fsync: bool = True,
    progress: bool = False,
):
    """``convert quantize --recipe / --dp/--tp/--ep/--pp``: every rank's slices of the quantized base,
    ``DST/rank_RRRRR/model.safetensors`` + layout.json (as ``convert hf-to-ms --recipe``), the metadata
    of :func:`quantize_checkpoint`. A split of ``in`` that cuts an int4 byte or a scale group is refused
    (checkpoint/layout.py ``quantized_layouts``)."""
    from ms_deepseek.checkpoint.convert.sharded import rank_entries
    from ms_deepseek.checkpoint.layout import LAYOUT_FILE, build_layout, checkpoint_inventory, rank_dir_name
    from ms_deepseek.checkpoint.safetensors_io import write_file
    from ms_deepseek.core.atomic import atomic_folder, check_destination
    from ms_deepseek.parallel_plan.validate import validate_layout

    src, dst = Path(src), Path(dst)
    spec = QuantSpec(bits=bits, group_size=group_size)
    opened = _float_source(src)
    cfg = opened.config
    check_groups({n: i.shape for n, i in opened.weights.tensors.items()}, spec, "--group-size")
    validate_layout(parallel, cfg)
    view = QuantizedView(opened.model, cfg, spec)
    dtypes = {i.name: opened.model.dtype(i.name) for i in checkpoint_inventory(cfg)}
    # each distinct slice once, in its owner's folder, as write_sharded does
    layout = build_layout(cfg, parallel, dtypes=dtypes, quant=spec).storing_distinct()
    check_destination(src, dst, overwrite)
    kinds = {"model_quant_type": f"W{bits}A16"}
    kinds.update({n: kinds["model_quant_type"] if n in view.float_of else "FLOAT" for n in layout.tensors})
    with atomic_folder(dst, fsync=fsync) as tmp:
        for rank in range(layout.world_size):
            folder = tmp / rank_dir_name(rank)
            folder.mkdir()
            write_file(folder / "model.safetensors", rank_entries(view, layout, rank), {"format": "ms"}, fsync=False)
            if progress:
                print(f"rank {rank + 1}/{layout.world_size} written", flush=True)
        layout.write(tmp / LAYOUT_FILE)
        _write_metadata(tmp, opened, src, spec, kinds)
    return layout


def _float_source(src: Path):
    from ms_deepseek.checkpoint.opener import CheckpointKind, open_checkpoint

    opened = open_checkpoint(src)
    if opened.quant is not None:
        raise UserError(
            f"{src}: already quantized (bits {opened.quant.bits}, group_size {opened.quant.group_size}); "
            "quantize the original checkpoint"
        )
    if opened.kind not in (CheckpointKind.HF, CheckpointKind.MS):
        raise UserError(
            f"{src}: a {opened.kind} checkpoint; quantize an HF or ms_deepseek model folder "
            "(convert a training checkpoint with `convert ms-to-hf` first)"
        )
    return opened


def original_of(folder: Path) -> Optional[Path]:
    """The float checkpoint a quantized folder was made from, if it still exists."""
    found = read_quant_config(folder)
    if found is None:
        return None
    original = found[1].get("original")
    path = Path(original) if isinstance(original, str) else None
    return path if path is not None and (path / "config.json").is_file() else None
