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
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
from mindspore import Parameter, Tensor, nn

from ms_deepseek.core.errors import UserError
from ms_deepseek.spec.lora import LORA_TARGETS, Q_VARIANTS, LoraSpec, target_matches

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
            raise UserError(f"{key}[{i}]: {target!r} matches no module of this model "
                            f"(adaptable: {', '.join(sorted({p.split('.')[-1] for p in modules}))})")
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


def attach(holder, experts, r: int, scaling: float, dropout: float, a: np.ndarray, b: np.ndarray,
           path: str) -> None:
    """Put one adapter (factors a, b) on a Linear or a stacked expert projection."""
    holder.lora_A = LoraWeight(a)
    holder.lora_B = LoraWeight(b)
    # the holder got its prefix when the model was built: name the new parameters by their full path
    holder.lora_A.weight.name = f"{path}.lora_A.weight"
    holder.lora_B.weight.name = f"{path}.lora_B.weight"
    holder.lora_scaling = float(scaling)
    holder.lora_dropout = nn.Dropout(p=dropout) if dropout > 0 else None


def add_adapters(model, spec: LoraSpec, seed: int = 0, key: str = "lora") -> List[str]:
    """Attach adapters to the modules ``spec.target_modules`` selects; returns their paths.

    Refuses (UserError naming the key) a target that matches nothing, a rank larger than a
    targeted layer (r > min(in, out)), and a model that already holds adapters."""
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
            raise UserError(f"{key}.r: {r} is larger than {path} ({shape[-2]} x {shape[-1]}); "
                            f"the rank must be <= {min(shape[-2:])}")
        a, b = _init_factors(shape, r, rng)
        attach(holder, experts, r, spec.alpha / r, spec.dropout, a, b, path)
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

