"""``DeepseekV2ForCausalLM.from_pretrained``: stream a checkpoint folder into a built model.

Accepts the HuggingFace layout (per-expert tensors) and the ms_deepseek layout
(stacked experts, converted folders and training checkpoints). Tensors are read one
at a time straight from the safetensors bytes (bfloat16 included, widened on the
host) and copied into the model's parameters; routed experts are stacked into one
buffer per (layer, projection) that is handed over as soon as its last expert
arrives, so the host never holds a second copy of the model, only the layers in flight.
"""

from __future__ import annotations

from typing import Dict, Tuple

import mindspore as ms
import numpy as np
from mindspore import Tensor

from ms_deepseek.checkpoint.opener import open_checkpoint
from ms_deepseek.checkpoint.safetensors_io import TensorInfo
from ms_deepseek.checkpoint.slice_readers import full_slice, pread_rows, to_float32
from ms_deepseek.config import names
from ms_deepseek.config.inventory import expected_ms_shapes
from ms_deepseek.core.dtypes import FLOAT_SAFETENSORS, raw_numpy
from ms_deepseek.core.errors import UserError
from ms_deepseek.core.progress import progress_bar

_READABLE = FLOAT_SAFETENSORS + ("F64",)  # what read_tensor widens to float32
_NP_OF_PARAM = {
    ms.float32: np.float32,
    ms.float16: np.float16,
    ms.bfloat16: np.float32,
}  # set_data: numpy has no bfloat16, MindSpore casts float32
_NOT_IN_CHECKPOINTS = ("expert_placement",)  # derived from the parallel plan, not a weight


def read_tensor(info: TensorInfo) -> np.ndarray:
    """The tensor's values as numpy (bfloat16 widened exactly to float32), through the checkpoint reader."""
    if info.dtype not in _READABLE:
        raise UserError(f"{info.file}: tensor {info.name} has dtype {info.dtype}; expected F32, F16 or BF16")
    if not info.shape or not info.nbytes:  # a scalar or an empty tensor: read as one row
        raw = np.frombuffer(_read_bytes(info), dtype=raw_numpy(info.dtype)).reshape(info.shape)
    else:
        raw = pread_rows(info, 0, info.shape[0])
    return to_float32(raw, info.dtype) if info.dtype == "BF16" else raw


def _read_bytes(info: TensorInfo) -> bytes:
    with open(info.file, "rb") as f:
        f.seek(info.offset)
        raw = f.read(info.nbytes)
    if len(raw) != info.nbytes:
        raise UserError(f"{info.file}: truncated while reading tensor {info.name}")
    return raw


def load_pretrained(cls, path, show_progress: bool = True, **config_overrides):
    opened = open_checkpoint(path)
    if opened.lora is not None:
        raise UserError(
            f"{path}: a LoRA checkpoint (adapters only); load its base with adapter=, after "
            f"`ms-deepseek export-lora {path} OUT` (or merge it: `export-lora {path} OUT --merge BASE`)"
        )
    if opened.quant is not None:  # int8 / int4 base (convert quantize): quantized layers, then their tensors
        from ms_deepseek.model.quant import load_quantized, quantize_model

        model = cls(opened.config.replace(**config_overrides) if config_overrides else opened.config)
        quantize_model(model, opened.quant, from_weights=False)
        load_quantized(model, opened, show_progress=show_progress)
        return model
    if opened.sharded:  # each tensor put together from its slices
        return _load_sharded(cls, opened, config_overrides)
    cfg = opened.config.replace(**config_overrides) if config_overrides else opened.config
    model = cls(cfg)
    load_weights(model, opened.weights, show_progress=show_progress)
    return model


def load_weights(model, ckpt, show_progress: bool = True) -> None:
    """Copy every tensor of ``ckpt`` into ``model``; UserError on missing / unexpected / misshaped tensors."""
    cfg = model.config
    params = {p.name: p for p in model.get_parameters()}
    expected = expected_ms_shapes(cfg)
    for name, shape in expected.items():  # the model and the layout table must agree
        if name not in params or tuple(params[name].shape) != tuple(shape):
            raise RuntimeError(f"internal: model parameter {name} does not match the checkpoint layout")
    E = cfg.n_routed_experts or 0
    pending: Dict[str, Tuple[np.ndarray, set]] = {}
    loaded = set()
    folder = ckpt.folder
    infos = sorted(ckpt.tensors.values(), key=lambda i: (str(i.file), i.offset))
    bar = progress_bar(
        total=sum(i.nbytes for i in infos),
        enabled=show_progress,
        unit="B",
        unit_scale=True,
        desc=f"loading {folder.name}",
        leave=False,
    )
    for info in infos:
        if info.name.split(".")[-1] in _NOT_IN_CHECKPOINTS:
            bar.update(info.nbytes)
            continue
        ms_name, expert = names.hf_to_ms(info.name)
        if ms_name not in expected and 0 in info.shape:
            continue  # e.g. shared experts of width 0 (n_shared_experts: 0) that the reference code still saves
        if ms_name not in expected:
            raise UserError(
                f"{info.file}: unexpected tensor {info.name} (not part of a DeepSeek-V2 model with this config.json)"
            )
        target = expected[ms_name]
        if expert is None:
            if tuple(info.shape) != tuple(target):
                raise UserError(
                    f"{info.file}: tensor {info.name} has shape {list(info.shape)}, config.json implies {list(target)}"
                )
            _assign(params[ms_name], read_tensor(info))
            loaded.add(ms_name)
        else:
            _stack_expert(info, ms_name, expert, target, E, pending, params, loaded)
        bar.update(info.nbytes)
    bar.close()
    _check_all_loaded(expected, loaded, pending, E, folder)


def _stack_expert(info, ms_name: str, expert: int, target, E: int, pending, params, loaded: set) -> None:
    """One expert's tensor into its stack ([E, ...], pending until complete); a complete stack is assigned."""
    if expert >= E or tuple(info.shape) != tuple(target[1:]):
        raise UserError(
            f"{info.file}: tensor {info.name} has shape {list(info.shape)} / expert {expert}, "
            f"config.json implies {E} experts of {list(target[1:])}"
        )
    if ms_name not in pending:
        pending[ms_name] = (np.empty(target, dtype=np.float32), set())
    stack, seen = pending[ms_name]
    stack[expert] = read_tensor(info)
    seen.add(expert)
    if len(seen) == E:  # the stack is complete: hand it over, free the buffer
        _assign(params[ms_name], stack)
        loaded.add(ms_name)
        del pending[ms_name]


def _check_all_loaded(expected, loaded: set, pending, E: int, folder) -> None:
    missing = [n for n in expected if n not in loaded]
    if missing:
        detail = missing[0]
        if missing[0] in pending:
            absent = sorted(set(range(E)) - pending[missing[0]][1])
            detail = f"{names.ms_to_hf(missing[0], E)[absent[0]]} (experts {absent[:8]} of {missing[0]})"
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise UserError(f"{folder}: checkpoint is missing tensor {detail}{more}")


def _assign(param, array: np.ndarray) -> None:
    np_dtype = _NP_OF_PARAM.get(param.dtype, np.float32)
    param.set_data(Tensor(np.ascontiguousarray(array, dtype=np_dtype), dtype=param.dtype))


def _load_sharded(cls, opened, config_overrides):
    """The whole model from a ``rank_RRRRR/`` checkpoint (e.g. to evaluate or generate from a sharded run)."""
    src, cfg = opened.model, opened.config
    cfg = cfg.replace(**config_overrides) if config_overrides else cfg
    model = cls(cfg)
    params = {p.name: p for p in model.get_parameters()}
    for name, t in src.layout.tensors.items():
        _assign(params[name], to_float32(src.read(name, full_slice(t.shape)), t.dtype))
    return model
