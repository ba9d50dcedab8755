"""LoRA adapters on a built DeepseekV2ForCausalLM, with PEFT's names.

An adapter is optional state inside the layers that already exist, never a second copy of
a layer: a :class:`~ms_deepseek.model.layers.Linear` with an adapter computes

    y = x W^T + (alpha / r) * dropout(x) A^T B^T          A [r, in], B [out, r]

and :class:`~ms_deepseek.model.moe.RoutedExperts` holds stacked adapters per projection,
A [E, r, in] and B [E, out, r], run in the same batched matmuls as the stacked expert
weights. :func:`add_adapters` walks the model (like ``apply_plan``) and puts adapters on the
modules the target list names, matched as PEFT matches ``target_modules``: a module path
equal to the name or ending in ``"." + name``. Our paths are the HF module paths except the
routed experts, whose stack ``mlp.experts.gate_proj`` stands for the per-expert modules
``mlp.experts.{e}.gate_proj`` of the released checkpoints; so ``gate_proj`` adapts the dense
MLP, the shared experts and every routed expert, ``experts.gate_proj`` only the routed ones,
``shared_experts.gate_proj`` only the shared ones.

Parameter names: ``<module>.lora_A.weight`` / ``<module>.lora_B.weight`` (PEFT's, without
the ``base_model.model.`` prefix); a stacked expert adapter splits along axis 0 into PEFT's
per-expert tensors (``mlp.experts.{e}.gate_proj.lora_A.weight``), in expert order.
"""

from __future__ import annotations

import math
import re
import zlib
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
from mindspore import Parameter, Tensor, nn, ops
from mindspore.common import dtype as mstype

from ms_deepseek.config.lora import LORA_TARGETS, Q_VARIANTS, LoraSpec, target_matches
from ms_deepseek.core.errors import UserError

_ROUTER = re.compile(r"^model\.layers\.\d+\.mlp\.gate\.weight$")
_EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")


class LoraWeight(nn.Cell):
    """One adapter factor ``weight`` (a Cell so the parameter is named ``lora_A.weight`` as in PEFT)."""

    def __init__(self, array: np.ndarray):
        super().__init__()
        self.weight = Parameter(Tensor(array.astype(np.float32)), name="weight")


def adaptable_modules(model) -> Dict[str, Tuple[object, Optional[object]]]:
    """Module path -> (cell holding the adapter, owning RoutedExperts or None) for every module LoRA can target.

    Linear layers of attention and MLPs (not the lm_head) and the three stacked projections of
    each RoutedExperts (paths ``...mlp.experts.gate_proj`` etc.)."""
    from ms_deepseek.model.layers import Linear
    from ms_deepseek.model.moe import RoutedExperts

    out = {}
    for path, cell in model.cells_and_names():
        if isinstance(cell, Linear) and path.rsplit(".", 1)[-1] in LORA_TARGETS:
            out[path] = (cell, None)
        elif isinstance(cell, RoutedExperts):
            for proj in _EXPERT_PROJS:
                out[f"{path}.{proj}"] = (getattr(cell, proj), cell)
    return out


def resolve_targets(model, targets: Sequence[str], key: str = "lora.target_modules") -> List[str]:
    """Module paths the target names select; UserError naming an entry that matches nothing."""
    modules = adaptable_modules(model)
    chosen: List[str] = []
    for i, target in enumerate(targets):
        hits = [p for p in modules if target_matches(p, target)]
        if not hits:
            other_q = [t for t in Q_VARIANTS if t != target and any(target_matches(p, t) for p in modules)]
            if target in Q_VARIANTS and other_q:
                continue  # q_proj vs q_a_proj/q_b_proj: the default list names both variants
            raise UserError(
                f"{key}[{i}]: {target!r} matches no module of this model "
                f"(adaptable: {', '.join(sorted({p.split('.')[-1] for p in modules}))})"
            )
        chosen.extend(p for p in hits if p not in chosen)
    if not chosen:
        raise UserError(f"{key}: no module of this model is targeted")
    return chosen


def _init_factors(shape: Tuple[int, ...], r: int, rng: np.random.Generator) -> Tuple[np.ndarray, np.ndarray]:
    """PEFT's default init: A ~ kaiming-uniform(a=sqrt(5)) = U(-1/sqrt(in), 1/sqrt(in)), B = 0."""
    *lead, out_f, in_f = shape
    bound = 1.0 / math.sqrt(in_f)
    a = rng.uniform(-bound, bound, size=tuple(lead) + (r, in_f)).astype(np.float32)
    b = np.zeros(tuple(lead) + (out_f, r), np.float32)
    return a, b


# ------------------------------------------------------------------------------------ exact dropout
_KEY_ATTR = "_lora_dropout_key"
_MASK_BITS = 24  # the mask compares 24 bits of the hash with p * 2**24


def _int32(value: int) -> int:
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value >= 1 << 31 else value


def dropout_key(model, create: bool = False) -> Optional[Parameter]:
    """The model's dropout key (int32): what :class:`StepDropout` masks depend on besides the element and the
    adapter. Kept out of the model's parameters (no checkpoint, plan or loader sees it): the trainer sets it
    before every step (:func:`set_dropout_step`)."""
    key = getattr(model, _KEY_ATTR, None)
    if key is None and create:
        key = Parameter(Tensor(0, mstype.int32), name="lora_dropout_key", requires_grad=False)
        object.__setattr__(model, _KEY_ATTR, key)
    return key


def set_dropout_step(model, seed: int, step: int, rank: int = 0) -> None:
    """Key the masks of optimizer step ``step`` (of data-parallel rank ``rank``) under the run's ``seed``: the
    same three numbers give the same masks in any process, so a resumed run replays them exactly."""
    key = dropout_key(model)
    if key is not None:
        mixed = zlib.crc32(f"{int(seed)}:{int(step)}:{int(rank)}".encode())
        key.set_data(Tensor(_int32(mixed), mstype.int32))


class StepDropout(nn.Cell):
    """Dropout whose mask is a function of the dropout key (seed, step, rank), the adapter and the element only.

    MindSpore's ``nn.Dropout`` keeps its random state inside the kernel: a resumed run could not replay its
    masks, and on CPU two seeded runs of `tiny-lora-cpu` (dropout 0.05) parted after 5 steps. Here each
    element's keep/drop is a 32-bit integer hash (murmur3's finaliser) of its index, the adapter's id and the
    key, compared with ``p``; kept elements are scaled by ``1 / (1 - p)``. No state, so recompute and resume see
    the same masks. The micro-batches of one step (grad_accum_steps > 1) share the mask positions."""

    def __init__(self, p: float, site: str, key: Parameter):
        super().__init__()
        self.p = float(p)
        self.scale = 1.0 / (1.0 - float(p))
        self.threshold = int(round(float(p) * (1 << _MASK_BITS)))
        self.site = Tensor(_int32(zlib.crc32(site.encode()) * 0x9E3779B1), mstype.int32)
        object.__setattr__(self, "_key", key)  # shared by every adapter of the model, registered by none

    def construct(self, x):
        if not self.training or self.p == 0:
            return x
        idx = ops.arange(0, x.size, dtype=mstype.int32).reshape(x.shape)
        h = ops.bitwise_xor(idx, ops.bitwise_xor(self._key, self.site)) * (-1640531535)  # 0x9E3779B1
        h = ops.bitwise_xor(h, ops.bitwise_and(ops.bitwise_right_shift(h, Tensor(16, mstype.int32)), 0xFFFF))
        h = h * (-2048144789)  # 0x85EBCA6B
        h = ops.bitwise_xor(h, ops.bitwise_and(ops.bitwise_right_shift(h, Tensor(13, mstype.int32)), 0x7FFFF))
        h = h * (-1028477387)  # 0xC2B2AE35
        h = ops.bitwise_xor(h, ops.bitwise_and(ops.bitwise_right_shift(h, Tensor(16, mstype.int32)), 0xFFFF))
        u = ops.bitwise_and(ops.bitwise_right_shift(h, Tensor(32 - _MASK_BITS, mstype.int32)), (1 << _MASK_BITS) - 1)
        keep = (u >= self.threshold).astype(x.dtype)
        return x * keep * self.scale


def attach(
    holder,
    scaling: float,
    dropout: float,
    a: np.ndarray,
    b: np.ndarray,
    path: str,
    key: Optional[Parameter] = None,
) -> None:
    """Put one adapter (factors a, b) on a Linear or a stacked expert projection. With ``key`` (the model's
    :func:`dropout_key`) its dropout is a :class:`StepDropout` (exact on resume); without, MindSpore's own."""
    holder.lora_A = LoraWeight(a)
    holder.lora_B = LoraWeight(b)
    # the holder got its prefix when the model was built: name the new parameters by their full path
    holder.lora_A.weight.name = f"{path}.lora_A.weight"
    holder.lora_B.weight.name = f"{path}.lora_B.weight"
    holder.lora_scaling = float(scaling)
    if dropout <= 0:
        holder.lora_dropout = None
    elif key is not None:
        holder.lora_dropout = StepDropout(dropout, path, key)
    else:
        holder.lora_dropout = nn.Dropout(p=dropout)


def add_adapters(model, spec: LoraSpec, seed: int = 0, key: str = "lora", exact_dropout: bool = True) -> List[str]:
    """Attach adapters to the modules ``spec.target_modules`` selects; returns their paths.

    Refuses (UserError naming the key) a target that matches nothing, a rank larger than a
    targeted layer (r > min(in, out)), and a model that already holds adapters. ``exact_dropout``:
    :class:`StepDropout` (keyed by :func:`set_dropout_step`), else MindSpore's ``nn.Dropout``."""
    if has_adapters(model):
        raise UserError(f"{key}: the model already holds LoRA adapters")
    modules = adaptable_modules(model)
    paths = resolve_targets(model, spec.target_modules, f"{key}.target_modules")
    rng = np.random.default_rng(seed)
    for path in paths:
        holder, experts = modules[path]
        # [out, in] or [E, out, in]; a quantized layer (model/quant.py) stores packed weights, so ask it
        shape = tuple(getattr(holder, "dense_shape", holder.weight.shape))
        r = spec.r
        if r > min(shape[-2:]):
            raise UserError(
                f"{key}.r: {r} is larger than {path} ({shape[-2]} x {shape[-1]}); the rank must be <= {min(shape[-2:])}"
            )
        a, b = _init_factors(shape, r, rng)
        attach(
            holder,
            spec.alpha / r,
            spec.dropout,
            a,
            b,
            path,
            dropout_key(model, create=True) if exact_dropout and spec.dropout > 0 else None,
        )
    return paths


def has_adapters(model) -> bool:
    return any(".lora_A." in p.name for p in model.get_parameters())


def is_adapter_param(name: str) -> bool:
    return ".lora_A.weight" in name or ".lora_B.weight" in name


def freeze_base(model, train_router: bool = False) -> None:
    """Only adapters (and the routers when asked) train; every other parameter is frozen (no grads, no moments)."""
    for p in model.get_parameters():
        p.requires_grad = is_adapter_param(p.name) or (train_router and bool(_ROUTER.match(p.name)))


def trainable_tensors(model) -> Dict[str, Parameter]:
    """What a LoRA checkpoint holds: adapters (+ trained routers), under the model's own names."""
    return {name: p for name, p in model.parameters_and_names() if p.requires_grad}


def adapter_paths(model) -> Dict[str, Tuple[int, float]]:
    """Module path -> (rank, scaling) of every adapter on the model."""
    out = {}
    for path, (holder, _experts) in adaptable_modules(model).items():
        if getattr(holder, "lora_A", None) is not None:
            out[path] = (int(holder.lora_A.weight.shape[-2]), float(holder.lora_scaling))
    return out
