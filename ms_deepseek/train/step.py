"""The compiled training step: one graph per optimizer step.

``TrainStep(input_ids, labels) -> (outputs, grad_norm, lr, overflow, loss_scale)`` with
``input_ids`` / ``labels`` [k * b, T]: the step's ``k`` micro-batches of ``b`` sequences,
stacked in order.

* :class:`StepOutputs` runs the model on one micro-batch and returns one float32 vector
  ``[total, loss, aux_loss, moe_stats.flatten()] / k`` (``loss`` the LM cross-entropy,
  ``aux_loss`` the balance losses already times their alphas, ``total`` their sum).
* With ``k > 1`` it is wrapped in ``mindspore.parallel.nn.GradAccumulation`` (micro-batch
  ``i`` = rows ``[i*b, (i+1)*b)``, outputs and gradients summed over micro-batches: the
  MindSpore construct that semi-auto parallel compiles into accumulation on Ascend);
  with pipeline parallelism the trainer wraps it in ``Pipeline`` instead.
* The gradient is taken of ``total`` alone (sensitivity ``[loss_scale, 0, 0, ...]``), so
  ``k`` micro-batches of ``b`` give the same update as one batch of ``k * b``.
* :class:`Update`: all-reduce (mean) across data-parallel workers when a reducer is
  given, unscale (dynamic loss scale only: a static scale is 1.0), global norm (reported
  before clipping), clipping to ``clip_norm``, our AdamW (``optim.AdamW``, fused kernel)
  with the scheduled lr. With float16 compute the loss scale is dynamic: a step whose
  gradients overflow is skipped and the scale divided by ``factor``; after ``window`` good
  steps in a row it is multiplied by ``factor``.

Wrapping Cells use ``auto_prefix=False`` so the model's parameters keep their own names
(the checkpoint names).
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import mindspore as ms
from mindspore import Parameter, ParameterTuple, Tensor, nn, ops
from mindspore.common import dtype as mstype


class StepOutputs(nn.Cell):
    """One micro-batch -> ``[total, loss, aux_loss, stats...] / k`` (float32 vector of ``width``)."""

    def __init__(self, model: nn.Cell, accum_steps: int, num_moe_layers: int):
        super().__init__(auto_prefix=False)
        self.model = model
        self.inv_accum = 1.0 / accum_steps
        self.has_stats = num_moe_layers > 0
        # Called from Python (PyNative) the model returns an output object; inside a graph, a tuple.
        self.graph = ms.get_context("mode") == ms.GRAPH_MODE

    def construct(self, input_ids, labels):
        if self.graph:
            _, loss, aux_loss, stats = self.model(input_ids, labels)
        else:
            out = self.model(input_ids, labels)
            loss, aux_loss, stats = out.loss, out.aux_loss, out.moe_stats
        head = ops.stack((loss + aux_loss, loss, aux_loss)).astype(mstype.float32)  # [3]
        if self.has_stats:
            head = ops.concat((head, stats.reshape(-1).astype(mstype.float32)))  # [3 + L_moe * (E + 4)]
        return head * self.inv_accum


def _square_sum(g, as_dot: bool):
    """Sum of squares of ``g`` in float32.

    On CPU: one dot product of the flattened gradient with itself, a single GEMV (37 ms vs
    140 ms for ``(g * g).sum()`` over the 43.6M benchmark gradients on 2 cores). Elsewhere
    the elementwise form, which Ascend fuses, and which keeps a [1, N] @ [N, 1] matmul with
    N in the billions (a large expert shard) and the cube unit's fp32 precision mode out of it.
    """
    g = g.astype(mstype.float32)
    if as_dot:
        flat = g.reshape(1, -1)  # [1, N]
        return ops.matmul(flat, flat.reshape(-1, 1)).reshape(())  # [1, N] @ [N, 1] -> scalar
    return (g * g).sum()


class Update(nn.Cell):
    """Gradients -> (grad_norm, lr, overflow, loss_scale used): reduce, unscale, clip, AdamW."""

    def __init__(self, optimizer: nn.Cell, loss_scale: Parameter, clip_norm: Optional[float],
                 dynamic_loss_scale: bool, scale_factor: float = 2.0, scale_window: int = 1000,
                 grad_reducer: Optional[nn.Cell] = None):
        super().__init__(auto_prefix=False)
        self.optimizer = optimizer
        self.loss_scale = loss_scale
        self.clip = clip_norm
        self.dynamic = dynamic_loss_scale
        self.scale_factor = float(scale_factor)
        self.scale_window = int(scale_window)
        self.good_steps = Parameter(Tensor(0, mstype.int32), name="loss_scale_good_steps", requires_grad=False)
        self.reducer = grad_reducer
        self.dot_norm = ms.get_context("device_target") == "CPU"

    def construct(self, grads):
        scale = self.loss_scale * 1.0
        if self.reducer is not None:
            grads = self.reducer(grads)
        if self.dynamic:
            # a static scale is 1.0 (float32 / bfloat16 compute): no unscale pass over the gradients then
            inv = 1.0 / scale
            unscaled = ()
            for g in grads:
                unscaled = unscaled + (g.astype(mstype.float32) * inv,)
            grads = unscaled
        sq = ()
        for g in grads:
            sq = sq + (_square_sum(g, self.dot_norm),)
        grad_norm = ops.sqrt(ops.stack(sq).sum())
        overflow = ops.logical_not(ops.isfinite(grad_norm))
        if self.clip is not None:
            factor = self.clip / ops.maximum(grad_norm, self.clip)  # min(1, clip / norm)
            clipped = ()
            for g in grads:
                clipped = clipped + (g.astype(mstype.float32) * factor,)
            grads = clipped
        lr = self.optimizer.get_lr()
        if self.dynamic:
            if overflow:  # skip the update, shrink the scale
                ops.assign(self.loss_scale, ops.maximum(scale / self.scale_factor, 1.0))
                ops.assign(self.good_steps, 0)
            else:
                self.optimizer(grads)
                good = self.good_steps + 1
                grow = good >= self.scale_window
                ops.assign(self.loss_scale, ops.select(grow, scale * self.scale_factor, scale))
                ops.assign(self.good_steps, ops.select(grow, ops.zeros_like(good), good))
        else:
            self.optimizer(grads)
        return grad_norm, lr, overflow, scale


class TrainStep(nn.Cell):
    """Forward + backward over the step's micro-batches, then :class:`Update`."""

    def __init__(self, net: nn.Cell, weights: ParameterTuple, update: Update, width: int):
        super().__init__(auto_prefix=False)
        self.net = net
        self.weights = weights
        self.update = update
        self.grad = ops.GradOperation(get_by_list=True, sens_param=True)
        onehot = np.zeros(width, np.float32)
        onehot[0] = 1.0  # differentiate the total loss only; the other entries are reported
        self.onehot = Tensor(onehot)

    def construct(self, input_ids, labels):
        outputs = self.net(input_ids, labels)
        sens = self.onehot * self.update.loss_scale
        grads = self.grad(self.net, self.weights)(input_ids, labels, sens)
        grad_norm, lr, overflow, scale = self.update(grads)
        return outputs, grad_norm, lr, overflow, scale


def output_width(num_moe_layers: int, num_experts: int) -> int:
    return 3 + num_moe_layers * (num_experts + 4) if num_moe_layers else 3


def build_step(model: nn.Cell, optimizer: nn.Cell, accum_steps: int, num_moe_layers: int, num_experts: int,
               clip_norm: Optional[float], dynamic_loss_scale: bool, loss_scale_init: float = 65536.0,
               scale_factor: float = 2.0, scale_window: int = 1000, grad_reducer: Optional[nn.Cell] = None,
               wrap_net=None):
    """The step Cell and its loss-scale Parameter. ``wrap_net`` replaces the accumulation wrapper
    (the trainer passes the pipeline wrapper for pp > 1)."""
    net = StepOutputs(model, accum_steps, num_moe_layers)
    if wrap_net is not None:
        net = wrap_net(net)
    elif accum_steps > 1:
        from mindspore.parallel.nn import GradAccumulation

        net = GradAccumulation(net, accum_steps)
    scale = Parameter(Tensor(loss_scale_init if dynamic_loss_scale else 1.0, mstype.float32),
                      name="loss_scale", requires_grad=False)
    update = Update(optimizer, scale, clip_norm, dynamic_loss_scale, scale_factor, scale_window, grad_reducer)
    return TrainStep(net, optimizer.parameters, update, output_width(num_moe_layers, num_experts)), update
