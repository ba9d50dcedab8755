"""The one MindFormers adapter: AdamW and the cosine schedule, imported lazily.

Importing MindFormers costs seconds, writes a log folder (``LOG_MF_PATH``, which we
point at the run's ``logs/`` first), prints, and its ``get_context`` resets MindSpore
to PyNative: call :func:`build_optimizer` *before* setting the execution mode.

MindFormers' ``AdamW`` is the decoupled-weight-decay Adam with bias correction and
float32 moments (``adam_m.*``, ``adam_v.*``) and a ``global_step`` counter; it compiles
and runs in graph mode on CPU. (``nn.AdamWeightDecay`` has no bias correction.)
Norm weights, biases and the router are not decayed, as in the DeepSeek recipes.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, List, Optional

from mindspore import Parameter, nn

from ms_deepseek.train import schedules

_MF = None


def _mindformers(log_dir: Optional[Path]):
    """Import the two MindFormers classes we use, with its log folder set first."""
    global _MF
    if _MF is None:
        if log_dir is not None:
            Path(log_dir).mkdir(parents=True, exist_ok=True)
            os.environ["LOG_MF_PATH"] = str(log_dir)
        else:
            os.environ.setdefault("LOG_MF_PATH", str(Path.cwd() / "logs" / "mindformers"))
        import warnings

        saved = warnings.showwarning  # MindFormers replaces it on import
        from mindformers.core.lr.lr_schedule import CosineWithWarmUpLR
        from mindformers.core.optim.adamw import AdamW

        warnings.showwarning = saved
        _MF = {"AdamW": AdamW, "CosineWithWarmUpLR": CosineWithWarmUpLR}
    return _MF


def build_lr_schedule(optim_cfg, total_steps: int, log_dir: Optional[Path] = None) -> nn.Cell:
    """The schedule Cell for ``optim_cfg.schedule``, evaluated at ``global_step + 1``."""
    kind = optim_cfg.schedule
    if kind == "cosine":
        mf = _mindformers(log_dir)
        inner = mf["CosineWithWarmUpLR"](learning_rate=float(optim_cfg.lr), warmup_steps=int(optim_cfg.warmup_steps),
                                         total_steps=int(total_steps), lr_end=float(optim_cfg.min_lr))
    elif kind == "step":
        inner = schedules.WarmupStepDecayLR(optim_cfg.lr, optim_cfg.warmup_steps,
                                            schedules.milestone_steps(total_steps, optim_cfg.milestones),
                                            optim_cfg.decay_factor)
    elif kind == "constant":
        inner = schedules.WarmupConstantLR(optim_cfg.lr, optim_cfg.warmup_steps)
    else:  # the recipe validator only lets the three through
        raise ValueError(f"unknown schedule {kind!r}")
    return schedules.NextStep(inner)


def lr_fn(optim_cfg, total_steps: int):
    """Python mirror of the schedule: step (1-based) -> lr."""
    return lambda step: schedules.lr_at(step, schedule=optim_cfg.schedule, lr=optim_cfg.lr, total_steps=total_steps,
                                        warmup_steps=optim_cfg.warmup_steps, min_lr=optim_cfg.min_lr,
                                        milestones=optim_cfg.milestones, decay_factor=optim_cfg.decay_factor)


def _no_decay(name: str) -> bool:
    return (name.endswith("layernorm.weight") or name.endswith("norm.weight") or name.endswith(".bias")
            or name.endswith("mlp.gate.weight"))


def build_optimizer(params: List[Parameter], optim_cfg, total_steps: int, log_dir: Optional[Path] = None):
    """MindFormers AdamW over ``params`` (weight decay off for norms, biases, routers)."""
    mf = _mindformers(log_dir)
    lr = build_lr_schedule(optim_cfg, total_steps, log_dir)
    decay = [p for p in params if not _no_decay(p.name)]
    no_decay = [p for p in params if _no_decay(p.name)]
    groups: List[Dict] = []
    if decay:
        groups.append({"params": decay, "weight_decay": float(optim_cfg.weight_decay)})
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    groups.append({"order_params": params})
    return mf["AdamW"](groups, learning_rate=lr, betas=(float(optim_cfg.beta1), float(optim_cfg.beta2)),
                       eps=float(optim_cfg.eps), weight_decay=float(optim_cfg.weight_decay))


def optimizer_state(optimizer) -> Dict[str, Parameter]:
    """Name -> Parameter of everything the optimizer carries between steps.

    Names: ``global_step``, ``adam_m.<param>``, ``adam_v.<param>`` with the model's own
    parameter names (``optimizer.parameters`` order).
    """
    out: Dict[str, Parameter] = {"global_step": optimizer.global_step}
    for param, m, v in zip(optimizer.parameters, optimizer.exp_avg, optimizer.exp_avg_sq):
        out[f"adam_m.{param.name}"] = m
        out[f"adam_v.{param.name}"] = v
    return out
