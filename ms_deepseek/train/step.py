"""The compiled training step: one graph per optimizer step.

``TrainStep(input_ids, labels) -> (outputs, grad_norm, lr, overflow, loss_scale)`` with
``input_ids`` / ``labels`` [k * b, T]: the step's ``k`` micro-batches of ``b`` sequences,
stacked in order.

* :class:`StepOutputs` runs the model on one micro-batch and returns one float32 vector
  ``[total, loss, aux_loss, moe_stats.flatten()] / k`` (``loss`` the LM cross-entropy,
  ``aux_loss`` the balance losses already times their alphas, ``total`` their sum).
* With ``k > 1`` (micro-batch ``i`` = rows ``[i*b, (i+1)*b)``, outputs and gradients summed
  over micro-batches) it is wrapped in ``mindspore.parallel.nn.GradAccumulation`` in a sharded
  layout (the construct semi-auto parallel compiles into accumulation on Ascend), in
  :class:`OrderedAccumulation` otherwise (one micro-batch's activations at a time); with
  pipeline parallelism the trainer wraps it in ``Pipeline`` instead.
* The gradient is taken of ``total`` alone (sensitivity ``[loss_scale, 0, 0, ...]``), so
  ``k`` micro-batches of ``b`` give the same update as one batch of ``k * b``.
* :class:`Update`: all-reduce (mean) across data-parallel workers when a reducer is
  given, unscale (dynamic loss scale only: a static scale is 1.0), global norm (reported
  before clipping, see :func:`global_norm`), clipping to ``clip_norm``, our AdamW
  (``optim.AdamW``, fused kernel) with the scheduled lr. With float16 compute the loss scale
  is dynamic: a step whose gradients overflow is skipped and the scale divided by
  ``factor``; after ``window`` good steps in a row it is multiplied by ``factor``.
* Pipeline parallelism (Ascend, ``pp > 1``): the trainer wraps :class:`StepOutputs` in
  ``mindspore.parallel.nn.Pipeline`` (micro-batches, the plan's stages) and the step gets a
  :class:`PipelineGrads`: the ``accu_grads.<param>`` Parameters MindSpore's pipeline pass
  accumulates every micro-batch's gradient into, handed to :class:`Update` (divided by the
  loss scale) and zeroed for the next step. The pattern is MindFormers'
  ``MFPipelineWithLossScaleCell`` (``mindformers/wrapper/wrapper.py``, ran on 910B) and
  MindSpore's documented ``PipelineGradReducer`` path.

Wrapping Cells use ``auto_prefix=False`` so the model's parameters keep their own names
(the checkpoint names).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import mindspore as ms
import numpy as np
from mindspore import Parameter, ParameterTuple, Tensor, mint, nn, ops
from mindspore.common import dtype as mstype
from mindspore.ops import composite as C
from mindspore.ops import operations as P

from ms_deepseek.config.parallel import ParallelConfig
from ms_deepseek.config.recipe import TrainSection


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


class OrderedAccumulation(nn.Cell):
    """``k`` micro-batches' summed outputs and gradients, each micro-batch's forward after the previous
    one's backward: one micro-batch's activations alive at a time.

    For accumulation without MindSpore's accumulation pass (one NPU, plain data parallel, CPU), where
    ``GradAccumulation`` is only the unrolled sum of the forwards and the gradient of that sum leaves
    MindSpore's scheduler free to interleave micro-batches: at level 1 of ``v2-lite-lora-1npu`` (2
    micro-steps) both micro-steps' loss backwards ran together, two [n, V] float32 ``Exp``, ``Tile``
    and ``GatherD`` gradients at once. Here each micro-batch's outputs and gradient come from one
    ``value_and_grad`` (one forward) and its input waits (``ops.depend``) on the previous micro-batch's
    gradients. Micro-batch ``i`` is rows ``[i*b, (i+1)*b)``, as ``GradAccumulation`` splits them."""

    def __init__(self, net: nn.Cell, weights: ParameterTuple, accum_steps: int):
        super().__init__(auto_prefix=False)
        self.net = net
        self.weights = weights
        self.accum_steps = accum_steps

    def construct(self, input_ids, labels, sens):
        b = input_ids.shape[0] // self.accum_steps
        outputs = None
        grads = None
        for i in range(self.accum_steps):
            ids = input_ids[i * b : (i + 1) * b]  # [b, T]
            lab = labels[i * b : (i + 1) * b]
            if grads is not None:
                ids = ops.depend(ids, grads)  # after the previous micro-batch's whole backward
            # one forward for the outputs and the gradient: a separate call was not merged with the
            # gradient's forward (level 1 of v2-lite-lora-1npu: 2k sets of dropout masks, not k)
            out, g = ms.value_and_grad(self.net, None, self.weights, sens_param=True)(ids, lab, sens)
            if grads is None:
                outputs, grads = out, g
            else:
                outputs = outputs + out
                grads = tuple(a + c for a, c in zip(grads, g))
        return outputs, grads


# The marker MindSpore's parallel pass looks for (frontend/parallel/step_parallel.cc,
# HandleGlobalNormScale; the pattern of MindFormers' core/clip_grad.py): from each parameter's
# gradient it walks Cast / Mul / Square / ReduceSum / SumExt / Depend nodes to an ExpandDims
# carrying ``grad_scale``, divides that square sum by the parameter's replica count, and
# all-reduces the sum reaching the next Sqrt over the stage's devices (and between pipeline
# stages): every rank then holds the global norm, not its own slices' partial one.
_NORM_MARKER = P.ExpandDims().add_prim_attr("grad_scale", True)


def _dot_square_sum(g):
    """CPU (stand-alone / data parallel): the square sum of ``g`` as one dot product of the
    flattened gradient with itself: one GEMV, several times faster on CPU than ``(g * g).sum()``
    (figures: docs/training.md)."""
    flat = g.astype(mstype.float32).reshape(1, -1)  # [1, N] (float32 on CPU: no copy)
    return ops.matmul(flat, flat.reshape(-1, 1)).reshape(())  # [1, N] @ [N, 1] -> scalar


def _marked_square_sum(g):
    """The square sum of ``g`` as [1] float32, in the marker pattern (Ascend, any layout).

    Only ops the parallel pass walks through (Square, SumExt, Cast), which rules out the
    reshape + matmul of the CPU form. No float32 copy of the gradient: the square is taken in
    the gradient's own dtype (bfloat16 has float32's range; one temporary of this gradient's
    size, freed after its reduction) and ``SumExt(dtype=float32)`` accumulates in float32 (on
    Ascend aclnnReduceSum with a float32 output: the widening happens inside the one reduce
    kernel, one gradient at a time). The per-element rounding of a bfloat16 square (2**-9,
    unbiased) leaves the norm within ~1e-3 relative. float16 squares overflow above 256, so a
    float16 gradient (CPU fp16 runs with a dynamic loss scale) is widened first.
    """
    if g.dtype == mstype.float16:
        g = g.astype(mstype.float32)
    return _NORM_MARKER(mint.sum(ops.square(g), dtype=mstype.float32), 0)  # [1]


def global_norm(grads, as_dot: bool):
    """L2 norm of all gradients (float32 scalar). ``as_dot``: the CPU GEMV form; otherwise the
    ``grad_scale`` marker pattern, which MindSpore completes across model-parallel slices and
    pipeline stages under SEMI/AUTO parallel (and which is exact as it is elsewhere)."""
    if as_dot:
        sq = ()
        for g in grads:
            sq = sq + (_dot_square_sum(g),)
        return ops.sqrt(ops.stack(sq).sum())
    sq = ()
    for g in grads:
        sq = sq + (_marked_square_sum(g),)
    return ops.sqrt(ops.addn(sq)).reshape(())  # AddN then Sqrt: where the pass inserts its AllReduce


def _zeros_in_place_of(accu_grad):
    """Zeros shaped like ``accu_grad``, computed from it when the step runs rather than a constant:
    MindSpore folds ``zeros_like`` of a static shape into a constant of the parameter's full, unsliced
    shape, one per buffer. Found twice: the compile check's IR (an fp32 [102400, 5120] zero tensor for the
    embedding's buffer alone, in host memory) and MindSpore's level-1 accounting of v2-lite-sft-8npu
    (``plan --compile --memory``: zero constants as large as the buffers, held by the device for the whole
    run). ``nan_to_num`` makes the zeros exact also where the buffer overflowed
    (0 * inf is NaN), which a float16 run's skipped step leaves behind."""
    return ops.nan_to_num(accu_grad * 0.0, 0.0, 0.0, 0.0)


_take_accumulated = C.MultitypeFuncGraph("take_accumulated")


@_take_accumulated.register("Tensor", "Tensor", "Tensor")
def _take_accumulated_grad(scale, grad, accu_grad):
    """Pipeline, no optimizer sharding: the gradient is what the pass accumulated into ``accu_grad``
    (``grad`` only orders it); the result is a new tensor, and ``accu_grad`` is zeroed after it."""
    accu_grad = ops.depend(accu_grad, grad)
    new_grad = accu_grad * ops.reciprocal(scale).astype(accu_grad.dtype)  # in the gradient's dtype
    accu_grad = ops.depend(accu_grad, new_grad)
    new_grad = ops.depend(new_grad, ops.assign(accu_grad, _zeros_in_place_of(accu_grad)))
    return new_grad


_take_sharded = C.MultitypeFuncGraph("take_sharded")


@_take_sharded.register("Tensor", "Tensor", "Tensor")
def _take_sharded_grad(scale, grad, accu_grad):
    """Pipeline with optimizer sharding: MindSpore hands the accumulated (reduce-scattered)
    gradient itself; ``accu_grad`` is only zeroed."""
    new_grad = grad * ops.reciprocal(scale).astype(grad.dtype)
    accu_grad = ops.depend(accu_grad, new_grad)
    new_grad = ops.depend(new_grad, ops.assign(accu_grad, _zeros_in_place_of(accu_grad)))
    return new_grad


class PipelineGrads(nn.Cell):
    """``accu_grads.<param>``: a zero clone of every optimizer parameter (same shape and dtype),
    the buffers MindSpore's pipeline pass accumulates each micro-batch's gradient into.
    ``(grads, scale) -> gradients / scale`` for :class:`Update`, zeroing the buffers.

    Written after MindFormers' ``MFPipelineWithLossScaleCell`` (``grad_scale`` /
    ``shard_grad_scale``) rather than taken from ``mindspore.parallel.nn.PipelineGradReducer``,
    whose ``opt_shard=False`` branch in MindSpore 2.9.0 reads an undefined ``grads`` (graph
    compile fails: "The name 'grads' is not defined"); the deprecated
    ``mindspore.nn.PipelineGradReducer`` has the same semantics as this cell. Only Mul, Cast
    and Depend lie between a gradient and the norm, so the norm marker still finds it.
    """

    def __init__(self, parameters: ParameterTuple, optimizer_shard: bool):
        super().__init__(auto_prefix=False)
        from ms_deepseek.train.optim import zero_states

        # not parameters.clone(init="zeros"): that breaks a model built under no_init_parameters
        self.accu_grads = zero_states(parameters, "accu_grads")
        self.opt_shard = optimizer_shard
        self.hyper_map = ops.HyperMap()

    def construct(self, grads, scale):
        if self.opt_shard:
            return self.hyper_map(ops.partial(_take_sharded, scale), grads, self.accu_grads)
        return self.hyper_map(ops.partial(_take_accumulated, scale), grads, self.accu_grads)


@dataclass(frozen=True)
class LossScaling:
    """The loss scale's schedule: fixed (``dynamic`` False: the scale stays as set), or dynamic (divided by
    ``factor`` on an overflow, multiplied by it after ``window`` steps without one)."""

    dynamic: bool = False
    factor: float = 2.0
    window: int = 1000


class Update(nn.Cell):
    """Gradients -> (grad_norm, lr, overflow, loss_scale used): reduce, unscale, clip, AdamW."""

    def __init__(
        self,
        optimizer: nn.Cell,
        loss_scale: Parameter,
        clip_norm: Optional[float],
        scaling: Optional["LossScaling"] = None,
        grad_reducer: Optional[nn.Cell] = None,
        dot_norm: Optional[bool] = None,
        pre_unscaled: bool = False,
    ):
        super().__init__(auto_prefix=False)
        scaling = scaling or LossScaling()
        self.optimizer = optimizer
        self.loss_scale = loss_scale
        self.clip = clip_norm
        self.dynamic = scaling.dynamic
        self.scale_factor = float(scaling.factor)
        self.scale_window = int(scaling.window)
        self.good_steps = Parameter(Tensor(0, mstype.int32), name="loss_scale_good_steps", requires_grad=False)
        self.reducer = grad_reducer
        # the CPU GEMV norm (stand-alone / data parallel only: the marker pattern is what a
        # sharded graph needs); None = by device
        self.dot_norm = ms.get_context("device_target") == "CPU" if dot_norm is None else bool(dot_norm)
        self.pre_unscaled = pre_unscaled  # PipelineGrads already divided by the loss scale

    def construct(self, grads):
        scale = self.loss_scale * 1.0
        if self.reducer is not None:
            grads = self.reducer(grads)
        if self.dynamic and not self.pre_unscaled:
            # a static scale is 1.0 (float32 / bfloat16 compute): no unscale pass over the gradients then
            inv = 1.0 / scale
            unscaled = ()
            for g in grads:
                unscaled = unscaled + (g.astype(mstype.float32) * inv,)
            grads = unscaled
        grad_norm = global_norm(grads, self.dot_norm)
        # the norm is global (all-reduced by the marker pattern when sharded): every rank agrees on
        # overflow, as MindFormers' all-reduced overflow status does
        overflow = ops.logical_not(ops.isfinite(grad_norm))
        if self.clip is not None:
            factor = self.clip / ops.maximum(grad_norm, self.clip)  # min(1, clip / norm)
            clipped = ()
            for g in grads:
                # in the gradient's own dtype: no float32 copy of every gradient (the optimizer
                # widens one parameter's gradient at a time where its update needs it)
                clipped = clipped + (g * factor.astype(g.dtype),)
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

    def __init__(
        self,
        net: nn.Cell,
        weights: ParameterTuple,
        update: Update,
        width: int,
        pipeline: Optional[PipelineGrads] = None,
        n_update: Optional[int] = None,
    ):
        super().__init__(auto_prefix=False)
        self.net = net
        self.ordered = isinstance(net, OrderedAccumulation)  # it returns the outputs and the gradients
        self.weights = weights
        # gradients of weights[:n_update] reach the optimizer; the rest only anchor the graph (build_step)
        self.n_update = len(weights) if n_update is None else n_update
        self.update = update
        self.pipeline = pipeline
        self.grad = ops.GradOperation(get_by_list=True, sens_param=True)
        onehot = np.zeros(width, np.float32)
        onehot[0] = 1.0  # differentiate the total loss only; the other entries are reported
        self.onehot = Tensor(onehot)

    def construct(self, input_ids, labels):
        sens = self.onehot * self.update.loss_scale
        if self.ordered:
            outputs, grads = self.net(input_ids, labels, sens)
        else:
            outputs = self.net(input_ids, labels)
            grads = self.grad(self.net, self.weights)(input_ids, labels, sens)
        if self.pipeline is not None:  # the micro-batches' sum, accumulated by MindSpore's pipeline pass
            grads = self.pipeline(grads, self.update.loss_scale)
        grads = grads[: self.n_update]
        grad_norm, lr, overflow, scale = self.update(grads)
        return outputs, grad_norm, lr, overflow, scale


def output_width(num_moe_layers: int, num_experts: int) -> int:
    return 3 + num_moe_layers * (num_experts + 4) if num_moe_layers else 3


def build_step(
    model: nn.Cell,
    optimizer: nn.Cell,
    train: TrainSection,
    parallel: ParallelConfig,
    *,
    dynamic_loss_scale: bool = False,
    grad_reducer: Optional[nn.Cell] = None,
    wrap_net=None,
):
    """The step Cell and its :class:`Update`, from the recipe's ``train`` (clipping, accumulation,
    loss scale) and ``parallel`` sections. Micro-batches per step: ``parallel.micro_batches`` with
    pipeline parallelism (pp > 1), else ``train.grad_accum_steps``. ``wrap_net`` replaces the
    accumulation wrapper (the trainer passes the pipeline wrapper for pp > 1); pp > 1 adds the
    :class:`PipelineGrads` (``accu_grads.*``) the pipeline pass needs, and so does accumulation
    (k > 1) in a sharded layout. ``dynamic_loss_scale``:
    float16 compute."""
    cfg = model.config
    num_moe_layers, num_experts = len(cfg.moe_layer_indices), cfg.n_routed_experts or 0
    accum_steps = parallel.micro_batches if parallel.pp > 1 else train.grad_accum_steps
    # MindSpore's pipeline pass, and its accumulation pass under SEMI/AUTO parallel, sum the micro-batches'
    # gradients into ``accu_grads.<param>`` (graph_utils.cc CreateMirrorInput: "You should define
    # `accu_grads` when use _MicroStepAllGather"; MindSpore's own _TrainGradAccuStepCell defines them)
    pipeline = parallel.accumulation_pass(accum_steps)
    net = StepOutputs(model, accum_steps, num_moe_layers)
    ordered = False
    if wrap_net is not None:
        net = wrap_net(net)
    elif accum_steps > 1 and pipeline:
        # sharded: MindSpore's accumulation pass orders the micro-batches (and needs this construct)
        from mindspore.parallel.nn import GradAccumulation

        net = GradAccumulation(net, accum_steps)
    elif parallel.ordered_accumulation(accum_steps):
        ordered = True  # the weights are known below; OrderedAccumulation wraps net there
    scale = Parameter(
        Tensor(train.loss_scale_init if dynamic_loss_scale else 1.0, mstype.float32),
        name="loss_scale",
        requires_grad=False,
    )
    scaling = LossScaling(dynamic_loss_scale, train.loss_scale_factor, train.loss_scale_window)
    update = Update(optimizer, scale, train.clip_grad_norm, scaling, grad_reducer, pre_unscaled=pipeline)
    weights = optimizer.parameters
    embedding = model.model.embed_tokens.weight
    if pipeline and parallel.pp == 1 and not embedding.requires_grad:
        # A frozen embedding (LoRA) under MindSpore's accumulation pass: the pass marks the first node that
        # consumes a Parameter (the embedding's Gather) and needs that node's backward to find where each
        # micro-batch's backward ends (grad_accumulation_utils.cc TagMicroBatchBpEndPrim / TagMicroBatchBpEnd,
        # ReorderGradAccumulation: "Cannot find grad_accumulation border node"). Its gradient is therefore
        # taken (one [V, H] gradient and its accu_grads buffer, optimizer-sharded) and dropped before the
        # optimizer: the embedding stays frozen. It is marked trainable for the compile, as MindSpore's
        # accumulation and optimizer-sharding passes must agree on its gradient's slice and its
        # accu_grads buffer's (a frozen one got a full buffer against an optimizer-sharded gradient:
        # "For 'AssignAdd', 'value' must have the same shape as 'variable'").
        embedding.requires_grad = True
        weights = ParameterTuple(tuple(weights) + (embedding,))
    grads = PipelineGrads(weights, parallel.optimizer_shard) if pipeline else None
    if ordered:
        net = OrderedAccumulation(net, weights, accum_steps)
    step = TrainStep(
        net,
        weights,
        update,
        output_width(num_moe_layers, num_experts),
        pipeline=grads,
        n_update=len(optimizer.parameters),
    )
    return step, update
