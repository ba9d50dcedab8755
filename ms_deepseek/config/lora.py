"""LoRA, as data: the one spec of what is adapted, PEFT's target rule, and the adapter inventory.

:class:`LoraSpec` is the recipe's ``lora:`` section, the ``lora`` entry of a sharded checkpoint's
``layout.json``, what the planner sizes and what :func:`ms_deepseek.model.lora.add_adapters`
attaches. Pure Python: the Cells that hold adapters are in :mod:`ms_deepseek.model.lora`.

Targets are matched as PEFT matches ``target_modules``: a module path equal to the name or
ending in ``"." + name``. Our module paths are the HF ones except the routed experts, whose stack
``mlp.experts.gate_proj`` stands for the per-expert ``mlp.experts.{e}.gate_proj``; so
``gate_proj`` adapts the dense MLP, the shared experts and every routed expert,
``experts.gate_proj`` only the routed ones, ``shared_experts.gate_proj`` only the shared ones.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

from ms_deepseek.config.inventory import ParamInfo, parameter_inventory
from ms_deepseek.core.errors import UserError
from ms_deepseek.core.schema import check_at_most, from_dict

# the module leaves LoRA can adapt (attention, dense MLP, shared and routed experts; never lm_head)
LORA_TARGETS = (
    "q_proj",
    "q_a_proj",
    "q_b_proj",
    "kv_a_proj_with_mqa",
    "kv_b_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)
DEFAULT_TARGETS = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
Q_VARIANTS = ("q_proj", "q_a_proj", "q_b_proj")  # a model has either q_proj or q_a_proj + q_b_proj
PEFT_PREFIX = "base_model.model."


@dataclass
class LoraSpec:
    """LoRA fine-tuning (``lora:`` in the recipe; absent = full fine-tuning)."""

    r: int = 8  # adapter rank
    alpha: float = 16.0  # scaling alpha / r (PEFT's lora_alpha)
    dropout: float = 0.0  # dropout on the adapter input, training only
    target_modules: List[str] = field(default_factory=lambda: list(DEFAULT_TARGETS))
    train_router: bool = False  # also train mlp.gate.weight (saved with the adapter)

    def __post_init__(self):
        if self.r < 1:
            raise UserError(f"lora.r: must be >= 1, got {self.r}")
        check_at_most("lora.r", self.r, 2**17, "an adapter's rank; DeepSeek-V2's hidden size is 5120")
        if self.alpha <= 0:
            raise UserError(f"lora.alpha: must be > 0, got {self.alpha}")
        if not 0 <= self.dropout < 1:
            raise UserError(f"lora.dropout: must be in [0, 1), got {self.dropout}")
        if not self.target_modules:
            raise UserError("lora.target_modules: empty (name at least one of " + ", ".join(LORA_TARGETS) + ")")
        for i, name in enumerate(self.target_modules):
            leaf = name.rsplit(".", 1)[-1]
            if leaf not in LORA_TARGETS or not name.strip():
                raise UserError(
                    f"lora.target_modules[{i}]: unknown target module {name!r}; "
                    f"known: {', '.join(LORA_TARGETS)} (optionally prefixed: experts., "
                    f"shared_experts., mlp., self_attn.)"
                )

    def settings(self) -> Dict:
        """What a checkpoint records of it (``layout.json``'s ``lora`` entry): what decides its tensors."""
        return {
            "r": int(self.r),
            "target_modules": [str(t) for t in self.target_modules],
            "train_router": bool(self.train_router),
        }

    @classmethod
    def from_settings(cls, data: Optional[Dict], where: str) -> Optional["LoraSpec"]:
        """A recipe section or a layout entry (None stays None); errors name ``where``."""
        if data is None:
            return None
        if isinstance(data, LoraSpec):
            return data
        return from_dict(cls, data, where)


def target_matches(path: str, target: str) -> bool:
    """PEFT's rule for a target name: the module path equals it or ends with ``"." + target``."""
    return path == target or path.endswith("." + target)


def targeted(path: str, targets: Sequence[str]) -> bool:
    return any(target_matches(path, t) for t in targets)


def lora_inventory(cfg, lora: LoraSpec, inventory: Optional[List[ParamInfo]] = None) -> List[ParamInfo]:
    """The model's parameters under LoRA: every base weight frozen (the router trainable only with
    ``train_router``), plus the float32 adapters of each targeted module, named as model/lora.py
    names them (``<module>.lora_A.weight`` [.., r, in] / ``.lora_B.weight`` [.., out, r])."""
    inventory = inventory if inventory is not None else parameter_inventory(cfg)
    modules = [
        i.name[: -len(".weight")]
        for i in inventory
        if i.name.endswith(".weight") and i.name.rsplit(".", 2)[-2] in LORA_TARGETS
    ]
    for k, target in enumerate(lora.target_modules):
        if not any(target_matches(m, target) for m in modules):
            # naming the q variant this model does not have is not an error (the default list names both)
            if target in Q_VARIANTS and any(targeted(m, [q for q in Q_VARIANTS if q != target]) for m in modules):
                continue
            raise UserError(f"lora.target_modules[{k}]: {target!r} matches no module of this model")
    if not any(targeted(m, lora.target_modules) for m in modules):
        raise UserError("lora.target_modules: no module of this model is targeted")
    out: List[ParamInfo] = []
    for info in inventory:
        router = info.name.endswith("mlp.gate.weight")
        out.append(dataclasses.replace(info, trainable=info.trainable and router and lora.train_router))
        module, leaf = info.name.rsplit(".", 1)
        adaptable = leaf == "weight" and module.rsplit(".", 1)[-1] in LORA_TARGETS
        if not adaptable or not targeted(module, lora.target_modules):
            continue
        *lead, out_f, in_f = info.shape
        lead = tuple(lead)
        out.append(ParamInfo(module + ".lora_A.weight", lead + (lora.r, in_f), "float32", True, info.layer, info.kind))
        out.append(ParamInfo(module + ".lora_B.weight", lead + (out_f, lora.r), "float32", True, info.layer, info.kind))
    return out
