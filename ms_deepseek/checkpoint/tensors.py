"""Tensors in and out of a model or optimizer, and the RNG state, for training checkpoints.

* :func:`save_tensors`: one safetensors file (our one writer);
* :func:`model_tensors`: the model's parameters under its own names (the expert placement
  table is plan data, not saved); :func:`hf_ordered` puts stacked experts back in expert
  order when a placement permuted them into buffer order (``apply.restore_expert_order``),
  so every checkpoint stores experts in HF order whatever the placement;
* :func:`restore_into`: copy a checkpoint (any source, any layout) into the live
  parameters, whole or this rank's slices, experts into buffer order;
* :func:`rng_state` / :func:`restore_rng`: numpy and MindSpore generators, so a resume
  continues exactly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, Optional

import numpy as np

from ms_deepseek.core.errors import UserError


def save_tensors(named: Dict[str, object], path: Path) -> Dict:
    """One safetensors file of MindSpore tensors (or host arrays), written by the one writer
    (``safetensors_io.write_arrays``), one tensor on the host at a time; returns its size and digest, taken
    as the bytes were written (:mod:`.digests`)."""
    from ms_deepseek.checkpoint.digests import entry, new_hasher
    from ms_deepseek.checkpoint.safetensors_io import write_arrays

    hasher = new_hasher()
    size = write_arrays(path, {name: host_entry(value) for name, value in named.items()}, digest=hasher)
    return entry(size, hasher)


def host_entry(value):
    """(produce, safetensors code, shape) of a MindSpore tensor or a numpy array: ``produce()`` copies it to
    the host (bfloat16 through float32, exact: the writer rounds it back to the same bits)."""
    from ms_deepseek.core.dtypes import safetensors_code

    if isinstance(value, np.ndarray):
        return (lambda: value), safetensors_code(value.dtype.name), tuple(value.shape)
    name = str(value.dtype).lower()  # MindSpore: Float32, BFloat16, Bool, Int32 ...
    if name == "bfloat16":
        import mindspore as ms

        return (lambda: value.astype(ms.float32).asnumpy()), "BF16", tuple(value.shape)
    return value.asnumpy, safetensors_code(name), tuple(value.shape)


def model_tensors(model) -> Dict[str, object]:
    """The model's parameters under its own names, without the expert placement table (plan data)."""
    return {name: p for name, p in model.parameters_and_names() if not name.endswith("expert_placement")}


def _expert_order(name: str, applied) -> Optional[np.ndarray]:
    """The buffer order of a stacked expert tensor (or its optimizer state) under a placement, else None."""
    for path, order in (getattr(applied, "expert_orders", None) or {}).items():
        # our names ("model.layers.1.mlp.experts.up_proj.weight") and optimizer states ("adam_m.<name>")
        if name.startswith(path + ".") or ("." + path + ".") in name:
            return order
    return None


def hf_ordered(tensors: Dict[str, object], applied) -> Dict[str, object]:
    """``tensors`` with stacked experts (and their optimizer states) back in expert order
    (``apply.restore_expert_order``); only the tensors a placement permuted are copied to the host."""
    import mindspore as ms

    out = dict(tensors)
    for name, value in tensors.items():
        order = _expert_order(name, applied)
        if order is not None:
            array = value.asnumpy()
            restored = np.empty_like(array)
            restored[order] = array  # buffer row r holds expert order[r]
            out[name] = ms.Tensor(restored)
    return out


def to_buffer_order(name: str, array: np.ndarray, applied) -> np.ndarray:
    """Inverse of :func:`hf_ordered` for one tensor: an expert-ordered stack into buffer order."""
    order = _expert_order(name, applied)
    return array if order is None else array[order]


def restore_into(
    params: Dict[str, object], src, what: str, layout=None, rank: int = 0, applied=None, part=None
) -> None:
    """Copy tensors of ``src`` (a :mod:`.slice_readers` source) into ``params``: all must be present, shapes equal.

    With ``layout`` each parameter receives this rank's slice (the parameters of a compiled sharded
    step are slices); without, the whole tensor. ``part(name, slice)``: what of its slice the rank
    keeps (optimizer sharding: :meth:`ms_deepseek.checkpoint.opt_shard.OptimizerShards.part`)."""
    from mindspore import Tensor

    from ms_deepseek.checkpoint.slice_readers import full_slice, to_float32

    missing = [n for n in params if not src.has(n)]
    if missing:
        where = getattr(src, "folder", "")
        raise UserError(
            f"{where}: {what} tensor {missing[0]} is missing"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
            + "; the checkpoint does not match this recipe's model"
        )
    for name, param in params.items():
        if layout is not None and name in layout.tensors:
            sl = layout.slice_of(name, rank)
        else:
            sl = full_slice(_stored_shape(src, name, param))
        raw = src.read(name, sl)
        value = to_float32(raw, src.dtype(name)) if src.dtype(name) in ("BF16", "F16", "F32") else raw
        if layout is None:
            value = to_buffer_order(name, value, applied)
        elif part is not None:
            value = part(name, value)
        # a lazily built, not yet compiled parameter still has the full shape: it takes the slice as its data
        as_slice = layout is not None and name in layout.tensors and tuple(param.shape) == layout.tensors[name].shape
        if tuple(value.shape) != tuple(param.shape) and not as_slice:
            raise UserError(
                f"{getattr(src, 'folder', '')}: {what} tensor {name} has shape {list(value.shape)}, "
                f"the model has {list(param.shape)}"
            )
        np_dtype = {
            "Int32": np.int32,
            "Int64": np.int64,
            "Int8": np.int8,  # dtype table (int8 / uint8: a
            "UInt8": np.uint8,
        }.get(str(param.dtype), np.float32)  # quantized base, bits unchanged)
        # np.ascontiguousarray returns at least 1-D: keep a scalar (loss_scale, global_step) a scalar
        value = np.ascontiguousarray(value, dtype=np_dtype).reshape(value.shape)
        param.set_data(Tensor(value, dtype=param.dtype), slice_shape=tuple(value.shape) != tuple(param.shape))


def _stored_shape(src, name: str, param):
    info = getattr(src, "tensors", {}).get(name)
    if info is not None:
        return tuple(info.shape)
    layout = getattr(src, "layout", None)
    if layout is not None and name in layout.tensors:
        return layout.tensors[name].shape
    return tuple(param.shape)


def rng_state() -> Dict:
    import mindspore as ms

    np_state = np.random.get_state()
    return {
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "mindspore_seed": ms.get_seed(),
        "mindspore_generator": ms.get_rng_state().asnumpy().tolist(),
    }


def restore_rng(state: Dict) -> None:
    import mindspore as ms

    if state.get("mindspore_seed") is not None:  # first: mindspore.set_seed seeds numpy's generator too
        ms.set_seed(int(state["mindspore_seed"]))
    if "numpy" in state:
        kind, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
    if "mindspore_generator" in state:
        dtype = ms.get_rng_state().asnumpy().dtype  # the generator's own state dtype (uint8)
        ms.set_rng_state(ms.Tensor(np.asarray(state["mindspore_generator"], dtype=dtype)))
