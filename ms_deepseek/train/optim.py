"""AdamW (our own Cell over MindSpore's fused kernel) and the learning-rate schedules.

The schedules are :mod:`.schedules`' Cells (the cosine one computes MindFormers' ``CosineWithWarmUpLR``
without its branches, which split the compiled step; a test holds it to MindFormers').

:class:`AdamW` is decoupled-weight-decay Adam with bias correction, float32 moments
(``adam_m.*``, ``adam_v.*``) and a ``global_step`` counter: the update rule of
MindFormers' ``AdamW`` (a test compares the two over several steps). Each parameter is
updated by one call of MindSpore's fused ``ops.AdamWeightDecay`` kernel (CPU and Ascend
kernels) instead of a chain of elementwise ops, because the optimizer update is a large
part of a small model's step; the bias correction is folded into the kernel's scalar
inputs once per step (see :class:`AdamW`). ``nn.AdamWeightDecay`` uses the same kernel
but has no bias correction. Norm weights, biases and the router are not decayed, as in
the DeepSeek recipes. Measured figures: docs/training.md.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Dict, List

import mindspore as ms
import numpy as np
from mindspore import Parameter, ParameterTuple, Tensor, nn, ops
from mindspore.common import dtype as mstype
from mindspore.common.initializer import initializer
from mindspore.nn.optim.optimizer import Optimizer
from mindspore.ops.auto_generate import InplaceMuls

from ms_deepseek.train import schedules


def build_lr_schedule(optim_cfg, total_steps: int) -> nn.Cell:
    """The schedule Cell for ``optim_cfg.schedule``, evaluated at ``global_step + 1``."""
    kind = optim_cfg.schedule
    if kind == "cosine":
        inner = schedules.WarmupCosineLR(optim_cfg.lr, optim_cfg.warmup_steps, total_steps, optim_cfg.min_lr)
    elif kind == "step":
        inner = schedules.WarmupStepDecayLR(
            optim_cfg.lr,
            optim_cfg.warmup_steps,
            schedules.milestone_steps(total_steps, optim_cfg.milestones),
            optim_cfg.decay_factor,
        )
    elif kind == "constant":
        inner = schedules.WarmupConstantLR(optim_cfg.lr, optim_cfg.warmup_steps)
    else:  # the recipe validator only lets the three through
        raise ValueError(f"unknown schedule {kind!r}")
    return schedules.NextStep(inner)


def lr_fn(optim_cfg, total_steps: int):
    """Python mirror of the schedule: step (1-based) -> lr."""
    return lambda step: schedules.lr_at(
        step,
        schedule=optim_cfg.schedule,
        lr=optim_cfg.lr,
        total_steps=total_steps,
        warmup_steps=optim_cfg.warmup_steps,
        min_lr=optim_cfg.min_lr,
        milestones=optim_cfg.milestones,
        decay_factor=optim_cfg.decay_factor,
    )


def _no_decay(name: str) -> bool:
    return (
        name.endswith("layernorm.weight")
        or name.endswith("norm.weight")
        or name.endswith(".bias")
        or name.endswith("mlp.gate.weight")
    )


def zero_states(parameters, prefix: str, dtype=None) -> ParameterTuple:
    """Zeros shaped like each parameter (``dtype``: float32 optimizer moments; None: the parameter's own,
    MindSpore's ``accu_grads``), named ``<prefix>.<param name>``. Each shares its parameter's
    ``param_info`` clone, so a parallel layout applied to the parameter reaches its state, as
    ``ParameterTuple.clone`` does; unlike ``clone(init="zeros")`` it also works for parameters built
    under ``no_init_parameters`` (whose clone loses the deferred initialiser: "init_data must be set
    Tensor.init", ``mindspore/parallel/_utils.py`` ``_slice_parameter``).

    The state of a deferred parameter (a sharded run builds its model under ``no_init_parameters``) is
    deferred too: MindSpore then initialises only this rank's slice when the step compiles
    (``_slice_parameter``: ``init_data(layout)``), and the other stages' states never. Built eagerly
    (MindSpore 2.9's ``AutoParallel`` sets no parallel mode before the compile, so ``Parameter``
    initialises at once: ``Parameter._get_parameter_new_args``), every state was a zero array of the
    parameter's full, unsliced shape for every layer of every stage, which the compile then copied
    from, which for 236B pretraining exhausts the compile check's host at a fraction of the depth."""
    from mindspore.nn.utils import no_init_parameters

    states = []
    for param in parameters:
        state_dtype = param.dtype if dtype is None else dtype
        with no_init_parameters() if param.has_init else nullcontext():
            state = Parameter(initializer("zeros", param.shape, state_dtype))
        state.param_info = param.param_info.clone()
        if hasattr(param.param_info, "cloned_obj"):
            param.param_info.cloned_obj.append(state)
        else:
            param.param_info.cloned_obj = [state]
        state.name = f"{prefix}.{state.name}"
        states.append(state)
    return ParameterTuple(states)


class AdamW(Optimizer):
    """Decoupled AdamW with bias correction; one fused ``AdamWeightDecay`` call per parameter.

    ``params`` as for ``mindspore.nn.Optimizer`` (groups with ``weight_decay`` and
    ``order_params``). The update of step ``t`` (``global_step`` after the increment),
    with ``lr`` the schedule's value and ``wd`` the parameter's group decay, is
    MindFormers' ``AdamW``::

        m = b1 m + (1 - b1) g;   v = b2 v + (1 - b2) g^2
        p = p (1 - lr wd) - lr / bc1 * m / (sqrt(v / bc2) + eps),   bc1 = 1 - b1^t, bc2 = 1 - b2^t

    The fused kernel computes ``p -= lr' (m / (sqrt(v) + eps') + wd' p)``; multiplying the
    second term's numerator and denominator by ``sqrt(bc2)`` shows the two agree for
    ``lr' = lr sqrt(bc2) / bc1``, ``eps' = eps sqrt(bc2)`` and ``lr' wd' = lr wd``, i.e.
    ``wd' = wd bc1 / sqrt(bc2)``. Parameters not stored in float32 (``param_dtype``
    float16 / bfloat16) take the same update written out in float32 ops instead, because
    the fused kernel wants ``var`` and its moments in one dtype and the moments stay float32.
    """

    def __init__(self, params, learning_rate, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
        super().__init__(learning_rate, params, weight_decay=weight_decay)
        self.beta1 = Tensor(np.array([betas[0]], np.float32))
        self.beta2 = Tensor(np.array([betas[1]], np.float32))
        self.eps = Tensor(np.array([eps], np.float32))
        self.exp_avg = self._state("adam_m")
        self.exp_avg_sq = self._state("adam_v")
        self.fused = ops.AdamWeightDecay()
        self.beta1_value = float(betas[0])
        self.scale_in_place = InplaceMuls()  # the composite update's first op (_composite)
        self.is_fp32 = tuple(p.dtype == mstype.float32 for p in self._parameters)
        if not self.is_group:  # one decay for all: make it a per-parameter tuple like the grouped case
            self.weight_decay = tuple(self.weight_decay for _ in self._parameters)

    @property
    def in_graph(self) -> bool:
        """Whether the update compiles into a graph (read when it compiles: a constant there)."""
        return ms.get_context("mode") == ms.GRAPH_MODE

    def _state(self, prefix: str) -> ParameterTuple:
        return zero_states(self._parameters, prefix, mstype.float32)

    def construct(self, gradients):
        weight_decay = self.get_weight_decay()
        lr = self.get_lr()
        self.assignadd(self.global_step, self.global_step_increase_tensor)
        t = self.global_step.astype(mstype.float32)
        bc1 = 1.0 - ops.pow(self.beta1, t)
        bc2 = 1.0 - ops.pow(self.beta2, t)
        root_bc2 = ops.sqrt(bc2)
        lr_f = (lr * root_bc2 / bc1).astype(mstype.float32)  # lr'
        eps_f = self.eps * root_bc2  # eps'
        wd_scale = bc1 / root_bc2  # wd' = wd * wd_scale
        results = ()
        for i in range(len(self._parameters)):
            param, m, v, grad = self._parameters[i], self.exp_avg[i], self.exp_avg_sq[i], gradients[i]
            if not self.optim_filter[i]:  # optimizer-sharded away from this rank (Ascend layouts)
                results = results + (grad.astype(param.dtype),)
            elif self.is_fp32[i]:
                self.fused(
                    param,
                    m,
                    v,
                    lr_f,
                    self.beta1,
                    self.beta2,
                    eps_f,
                    weight_decay[i] * wd_scale,
                    grad.astype(mstype.float32),
                )
                results = results + (param,)
            else:
                results = results + (self._composite(param, m, v, grad, lr, weight_decay[i], bc1, bc2),)
        if self.use_parallel:
            self.broadcast_params(results)
        return results

    def _composite(self, param, m, v, grad, lr, wd, bc1, bc2):
        """The same update in float32 ops, for parameters stored in another dtype.

        Each float32 temporary is as large as the parameter, so two parameters' updates must not run side by
        side. Left to itself MindSpore's execution order ran them side by side: every parameter's first
        products as soon as their inputs existed, the rest later (level 1 of the dry run on v2-sft-64npu's
        rank 0: docs/measurements.md). Ordering them by ``depend`` from one parameter's result to the next
        gradient made a small pipeline's compile (tp 2, pp 2, 8 layers) run many times longer, hundreds of
        frames deep in one recursive frontend pass (gdb). So the update
        starts with a side effect, ``m *= beta1`` in place (``InplaceMuls``): MindSpore keeps side effects
        in program order (its auto-monad), so it comes after the previous parameter's last ``assign``, and
        every temporary below depends on it."""
        if self.in_graph:  # m * beta1, in m; after the last update
            m_decayed = self.scale_in_place(m, self.beta1_value)
        else:  # PyNative runs ops in program order (and has no CPU InplaceMuls)
            m_decayed = m * self.beta1
        g = ops.depend(grad, m_decayed).astype(mstype.float32)
        m_new = m_decayed + g * (1.0 - self.beta1)
        v_new = ops.depend(v, g) * self.beta2 + g * g * (1.0 - self.beta2)
        step = m_new / (ops.sqrt(v_new / bc2) + self.eps) * (lr / bc1)
        p_new = ops.depend(param, step).astype(mstype.float32) * (1.0 - lr * wd) - step
        p_new = ops.depend(p_new, ops.assign(m, m_new))
        p_new = ops.depend(p_new, ops.assign(v, v_new))
        p_new = p_new.astype(param.dtype)
        return ops.depend(p_new, ops.assign(param, p_new))


def build_optimizer(params: List[Parameter], optim_cfg, total_steps: int):
    """:class:`AdamW` over ``params`` (weight decay off for norms, biases, routers)."""
    lr = build_lr_schedule(optim_cfg, total_steps)
    decay = [p for p in params if not _no_decay(p.name)]
    no_decay = [p for p in params if _no_decay(p.name)]
    groups: List[Dict] = []
    if decay:
        groups.append({"params": decay, "weight_decay": float(optim_cfg.weight_decay)})
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    groups.append({"order_params": params})
    return AdamW(
        groups,
        learning_rate=lr,
        betas=(float(optim_cfg.beta1), float(optim_cfg.beta2)),
        eps=float(optim_cfg.eps),
        weight_decay=float(optim_cfg.weight_decay),
    )


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
