"""The compiled training step: micro-steps that accumulate gradients, and one update.

Two Cells share the model's parameters and an accumulation buffer per parameter:

* :class:`MicroStep` ``(input_ids, labels) -> (loss, aux_loss, moe_stats)``: forward and
  backward of ``(loss + aux_loss) * loss_scale / accum_steps``; the gradients are added
  into the buffers. ``loss`` is the LM cross-entropy, ``aux_loss`` the balance losses
  already multiplied by their alphas (the model does that).
* :class:`ApplyStep` ``() -> (grad_norm, lr, overflow, loss_scale)``: all-reduce (mean) of
  the buffers across data-parallel workers, unscale, global norm, clipping, AdamW
  (MindFormers) with the scheduled lr, buffers zeroed. With float16 compute the loss
  scale is dynamic: a step whose gradients overflow is skipped and the scale divided by
  ``factor``; after ``window`` good steps it is multiplied by ``factor``.

Wrapping Cells are built with ``auto_prefix=False`` so the model's parameters keep
their own names (the checkpoint names).

``k`` micro-steps of batch ``b`` then give the same update as one micro-step of batch
``k * b`` (the loss is a per-token mean, and micro-batches have equal token counts).
"""

from __future__ import annotations

from typing import Optional

import mindspore as ms
from mindspore import Parameter, ParameterTuple, Tensor, nn, ops
from mindspore.common import dtype as mstype


class _LossFn(nn.Cell):
    """``(input_ids, labels) -> (scaled total, loss, aux_loss, moe_stats)``; only the first is differentiated."""

    def __init__(self, model: nn.Cell, accum_steps: int):
        super().__init__(auto_prefix=False)
        self.model = model
        self.inv_accum = 1.0 / accum_steps
        # Called from Python (PyNative) the model returns an output object; inside a graph, a tuple.
        self.graph = ms.get_context("mode") == ms.GRAPH_MODE

    def construct(self, input_ids, labels, scale):
        if self.graph:
            _, loss, aux_loss, stats = self.model(input_ids, labels)
        else:
            out = self.model(input_ids, labels)
            loss, aux_loss, stats = out.loss, out.aux_loss, out.moe_stats
        total = (loss + aux_loss) * scale * self.inv_accum
        return total, loss, aux_loss, stats


class MicroStep(nn.Cell):
    def __init__(self, model: nn.Cell, weights: ParameterTuple, accum: ParameterTuple, loss_scale: Parameter,
                 accum_steps: int):
        super().__init__(auto_prefix=False)
        self.loss_fn = _LossFn(model, accum_steps)
        self.weights = weights
        self.accum = accum
        self.loss_scale = loss_scale
        self.grad_fn = ms.value_and_grad(self.loss_fn, None, self.weights, has_aux=True)

    def construct(self, input_ids, labels):
        (_, loss, aux_loss, stats), grads = self.grad_fn(input_ids, labels, self.loss_scale)
        done = ()
        for acc, g in zip(self.accum, grads):
            done = done + (ops.assign_add(acc, g.astype(acc.dtype)),)
        return ops.depend(loss, done), aux_loss, stats


class ApplyStep(nn.Cell):
    def __init__(self, optimizer: nn.Cell, accum: ParameterTuple, loss_scale: Parameter,
                 clip_norm: Optional[float], dynamic_loss_scale: bool, scale_factor: float = 2.0,
                 scale_window: int = 1000, grad_reducer: Optional[nn.Cell] = None):
        super().__init__(auto_prefix=False)
        self.optimizer = optimizer
        self.accum = accum
        self.loss_scale = loss_scale
        self.clip = clip_norm
        self.dynamic = dynamic_loss_scale
        self.scale_factor = float(scale_factor)
        self.scale_window = int(scale_window)
        self.good_steps = Parameter(Tensor(0, mstype.int32), name="loss_scale_good_steps", requires_grad=False)
        self.reducer = grad_reducer

    def construct(self):
        scale = self.loss_scale * 1.0
        # Unscaled copies of the buffers (so zeroing them afterwards cannot race the update).
        inv = 1.0 / scale
        grads = ()
        for acc in self.accum:
            grads = grads + (acc * inv,)
        if self.reducer is not None:
            grads = self.reducer(grads)
        sq = ()
        for g in grads:
            sq = sq + ((g * g).sum(),)
        grad_norm = ops.sqrt(ops.stack(sq).sum())
        overflow = ops.logical_not(ops.isfinite(grad_norm))
        if self.clip is not None:
            # min(1, clip / norm): a no-op below the threshold
            factor = self.clip / ops.maximum(grad_norm, self.clip)
            clipped = ()
            for g in grads:
                clipped = clipped + (g * factor,)
            grads = clipped
        lr = self.optimizer.get_lr()
        if self.dynamic:
            if overflow:
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
        zeroed = ()
        for acc in self.accum:
            zeroed = zeroed + (ops.assign(acc, ops.zeros_like(acc)),)
        grad_norm = ops.depend(grad_norm, zeroed)
        return grad_norm, lr, overflow, scale


def build_steps(model: nn.Cell, optimizer: nn.Cell, accum_steps: int, clip_norm: Optional[float],
                dynamic_loss_scale: bool, loss_scale_init: float = 65536.0, scale_factor: float = 2.0,
                scale_window: int = 1000, grad_reducer: Optional[nn.Cell] = None):
    """Micro and apply Cells, the accumulation buffers, and the loss-scale Parameter."""
    weights = optimizer.parameters
    accum = ParameterTuple([Parameter(ops.zeros(p.shape, mstype.float32), name=f"accum_grad.{p.name}",
                                      requires_grad=False) for p in weights])
    scale = Parameter(Tensor(loss_scale_init if dynamic_loss_scale else 1.0, mstype.float32),
                      name="loss_scale", requires_grad=False)
    micro = MicroStep(model, weights, accum, scale, accum_steps)
    apply = ApplyStep(optimizer, accum, scale, clip_norm, dynamic_loss_scale, scale_factor, scale_window,
                      grad_reducer)
    return micro, apply, scale
