"""Per-NPU memory of one training step: the bytes each pipeline stage holds, by category.

Pure Python, no MindSpore. The formulas are written out in ``docs/planner.md``;
names here follow that document. Everything is per NPU and per micro-batch unless
the name says otherwise. ``n`` = tokens of one micro-batch on one data-parallel
rank (micro_batch_size * seq_len); tp ranks see the same n tokens. What one micro-batch's
tensors take is :mod:`ms_deepseek.parallel_plan.activations`; FLOPs, traffic and bandwidth,
:mod:`ms_deepseek.parallel_plan.throughput`; the workload and precision,
:mod:`ms_deepseek.parallel_plan.workload`.

Principled terms and fitted constants. Every byte count (here and in ``activations``) is principled: shapes times dtype sizes, with
the lifetimes MindSpore gives them (each rule cites the MindSpore source that sets it), and each is checked
against MindSpore's own level-1 accounting (``plan --recipe R --compile --memory``; the runs are logged in
``docs/measurements.md``, never quoted here). Fitted or assumed, and marked so where defined:

* ``LOW`` / ``HIGH``: the efficiencies of the throughput range, each solved at one published run
  (``planner.calibration_anchors``; docs/planner.md, "Efficiencies");
* ``UPDATE_TEMPORARIES``: float32 images of a parameter in its composite update, the largest count level 1
  showed;
* ``Hardware.runtime_reserved_gb`` and ``Hardware.workspace_gb``: margins for what MindSpore's pool does not
  account (the CANN runtime, kernel workspaces), assumed, not measured on an NPU; ``Hardware.hccl_buffer_mb``
  is HCCL's default ``HCCL_BUFFSIZE`` (CANN's environment-variable reference).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from ms_deepseek.config.parallel import ParallelConfig
from ms_deepseek.config.quant import QuantSpec, is_quantized
from ms_deepseek.core.dtypes import itemsize
from ms_deepseek.core.errors import UserError
from ms_deepseek.parallel_plan.activations import (
    embedding_reduce_bytes,
    eval_layer_bytes,
    head_activation_bytes,
    head_backward_bytes,
    layer_activation_bytes,
    lora_dropout_bytes,
    moe_buffers,
    moe_transient_bytes,
)
from ms_deepseek.parallel_plan.plan import (
    Mesh,
    ParamInfo,
    Plan,
    layer_stages,
    optimizer_shard_group,
    parameter_inventory,
    shard_numel,
    stage_of_param,
)
from ms_deepseek.parallel_plan.workload import Precision, Workload

GB = 1024**3


@dataclass
class Hardware:
    """Ascend 910B (Atlas 800T A2) figures; every one is a planner flag."""

    hbm_gb: float = 64.0
    peak_tflops: float = 313.0  # bf16 dense
    hbm_tbps: float = 1.6
    hccs_gbps: float = 56.0  # per peer, inside a node (full mesh)
    roce_gbps: float = 25.0  # per NPU, across nodes
    npus_per_node: int = 8
    runtime_reserved_gb: float = 3.0  # ASSUMED: CANN runtime, kernels, HCCL bookkeeping, outside MindSpore's pool
    hccl_buffer_mb: float = 200.0  # HCCL_BUFFSIZE, one buffer per communication group
    workspace_gb: float = 1.0  # ASSUMED: operator workspaces and allocator slack (level 1 counts no workspace)
    low: "Efficiency" = None  # the throughput range's ends (default LOW / HIGH below)
    high: "Efficiency" = None

    def __post_init__(self):
        self.low = self.low or LOW
        self.high = self.high or HIGH


@dataclass(frozen=True)
class Efficiency:
    """What the software stack achieves of the hardware (docs/planner.md, "Efficiencies").

    ``compute``: fraction of the bf16 peak on the FLOPs the device executes (recompute and
    capacity padding included). ``comm``: fraction of the nominal link bandwidth a collective
    achieves. ``overlap``: fraction of the tp / ep collectives hidden under compute.
    """

    name: str
    compute: float
    comm: float
    overlap: float = 0.0


# The two ends of the throughput range, FITTED (not derived), each on one published run
# (planner.calibration_anchors; tests/unit/parallel_plan/test_planner.py re-derives both):
# LOW  = MindFormers' 236B fine-tune on 64 x 910B (dp4 tp8 pp2 ep4, seq 4096, cf 2, bf16, eager
#        attention, full recompute): 36 tokens/s/p. Assumed: collectives at 60% of the nominal
#        link bandwidth, no overlap (a MindSpore graph without communication overlap); the
#        compute efficiency is solved so the planner gives 36. MFU that figure implies: 1.8%.
# HIGH = DeepSeek-V2 pretraining on H800 (the paper: 172.8K GPU-hours per 1T tokens = 1,607
#        tokens/s per GPU; pp16 ep8 ZeRO-1 dp, no tp, seq 4096). Assumed: 80% of link bandwidth,
#        half of the tp/ep collectives hidden (the paper overlaps shared-expert compute with the
#        all-to-all); compute solved on H800 figures (planner.PAPER_H800). MFU implied: 25%.
LOW = Efficiency("low", compute=0.161, comm=0.6, overlap=0.0)
HIGH = Efficiency("high", compute=0.449, comm=0.8, overlap=0.5)


def param_layout(plan: Plan, name: str, mesh: Mesh) -> Tuple[int, ...]:
    """A parameter's layout from the plan; an adapter without a rule of its own is split like its
    base weight: A [.., r, in] keeps the base's split of ``in``, B [.., out, r] its split of
    ``out`` (and the expert axis of stacked adapters), the rank axis never split."""
    for part in (".lora_A.weight", ".lora_B.weight"):
        if name.endswith(part):
            try:
                return plan.param_layout(name, mesh)[1]
            except UserError:
                base = plan.param_layout(name[: -len(part)] + ".weight", mesh)[1]
                *lead, o, i = base
                return tuple(lead) + ((1, i) if part == ".lora_A.weight" else (o, 1))
    return plan.param_layout(name, mesh)[1]


# The categories of a stage's device memory, in the order they are summed and printed: the fields of
# StageMemory that make up its total and the keys of StageMemory.gb(). The last two exist only under a
# quantized base (QUANT_CATEGORIES).
MEMORY_CATEGORIES = (
    "weights",
    "weight_copies",
    "gradients",
    "optimizer",
    "activations",
    "working_set",
    "comm_buffers",
    "hccl_buffers",
    "workspace",
    "scales",
    "dequant_workspace",
)
QUANT_CATEGORIES = ("scales", "dequant_workspace")


@dataclass
class StageMemory:
    stage: int
    layers: int
    weights: float = 0.0
    weight_copies: float = 0.0
    gradients: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0
    working_set: float = 0.0
    comm_buffers: float = 0.0  # MoE all-to-all send / receive buffers (in MindSpore's pool)
    hccl_buffers: float = 0.0  # HCCL's own buffers, one per communication group (outside the pool)
    workspace: float = 0.0
    scales: float = 0.0  # quantized base: the float32 scales and offsets
    dequant_workspace: float = 0.0  # quantized base: the largest weight dequantised at once
    params: int = 0  # elements held (before optimizer sharding of weights)
    eval_peak: float = 0.0  # the whole device at the validation graph's peak (0: no validation)

    @property
    def total(self) -> float:
        """The training step's peak."""
        return sum(getattr(self, k) for k in MEMORY_CATEGORIES)

    @property
    def peak(self) -> float:
        """The device's peak over both graphs (training step, and validation when there is one)."""
        return max(self.total, self.eval_peak)

    @property
    def pool(self) -> float:
        """What MindSpore's device memory pool must hold (everything but HCCL's buffers)."""
        return self.peak - self.hccl_buffers

    def gb(self) -> Dict[str, float]:
        out = {k: round(getattr(self, k) / GB, 3) for k in MEMORY_CATEGORIES}
        out["total"] = round(self.total / GB, 3)
        if self.eval_peak:
            out["eval_total"] = round(self.eval_peak / GB, 3)
        return out


# ----------------------------------------------------------------------------- bytes held
def param_bytes(
    cfg,
    parallel: ParallelConfig,
    precision: Precision,
    inventory: Optional[List[ParamInfo]] = None,
    plan: Optional[Plan] = None,
    threshold_kb: int = 64,
    quant: Optional[QuantSpec] = None,
) -> List[Dict[str, float]]:
    """Per stage: weight / gradient / optimizer bytes and element counts of one NPU's slices.

    With ``quant`` the base weights :func:`ms_deepseek.config.quant.is_quantized` names count
    ``bits / 8`` bytes per element plus their float32 scales and offsets, and keep no cast copy;
    ``dequant`` is the largest of them dequantised to float32 (docs/planner.md, "Quantized base").
    """
    plan = plan or Plan()
    inventory = inventory if inventory is not None else parameter_inventory(cfg)
    mesh = Mesh.from_parallel(parallel)
    stages = layer_stages(cfg.num_hidden_layers, parallel.pp, parallel.stage_layers)
    out = [_held_slot() for _ in range(parallel.pp)]
    level2 = precision.optimizer_level in ("level2", "level3")
    for info in inventory:
        layout = param_layout(plan, info.name, mesh)
        local = shard_numel(info.shape, layout)
        size = itemsize(info.dtype)
        group = 1
        # MindSpore's parallel optimizer shards trainable parameters only: frozen (LoRA base)
        # weights stay whole on every dp replica.
        if parallel.optimizer_shard and info.trainable:
            group = optimizer_shard_group(info.shape, layout, mesh.stage_devices, size, threshold_kb)
        slot = out[stage_of_param(info, parallel.pp, stages)]
        slot["params"] += local
        if quant is not None and not info.trainable and is_quantized(info):
            _quantized_bytes(slot, info, layout, local, quant)
            slot["dequantized"] += local * precision.compute_bytes
            continue
        slot["weights"] += local * size / group
        if not info.trainable and info.name.startswith("model.embed_tokens"):
            slot["frozen_embedding"] = local * size
        if not info.trainable:
            # A frozen weight wider than the compute dtype is still cast for the matmul, and the
            # cast is kept for the activation gradient.
            if not info.is_buffer and size > precision.compute_bytes and not info.name.endswith("mlp.gate.weight"):
                slot["copies"] += local * precision.compute_bytes
            continue
        _trainable_bytes(slot, info, local, group, precision, level2)
    return out


def _held_slot() -> Dict[str, float]:
    """One stage's counters of :func:`param_bytes`, all zero."""
    return dict(
        weights=0.0,
        gradients=0.0,
        optimizer=0.0,
        copies=0.0,
        casts=0.0,
        params=0,
        largest_grad=0,
        largest_composite=0,  # elements of the largest non-float32 optimizer shard (the composite update)
        scales=0.0,
        dequant=0.0,
        dequantized=0.0,  # every quantized weight in the compute dtype (the unpacked images)
    )


def _trainable_bytes(slot, info: ParamInfo, local: int, group: int, precision: Precision, level2: bool) -> None:
    """Add a trainable parameter's gradient, optimizer states and compute-dtype copies (``local`` elements on this
    NPU, its optimizer states sharded ``group`` ways, its gradient too at ``level2``) to its stage's ``slot``."""
    size = itemsize(info.dtype)
    grad = precision.grad_bytes or size
    slot["gradients"] += local * grad / (group if level2 else 1)
    slot["largest_grad"] = max(slot["largest_grad"], local)
    if size < 4:  # updated by train/optim.py's float32 composite, on this rank's optimizer shard
        slot["largest_composite"] = max(slot["largest_composite"], local / group)
    slot["optimizer"] += local * (precision.optimizer_bytes + precision.master_bytes) / group
    # Compute-dtype copies the forward keeps for backward: casts of wider parameters, and the
    # all-gathered full slice of an optimizer-sharded parameter. The embedding table is gathered in its
    # own dtype (the Gather reads the table, the cast comes after): MindSpore's level-1 dump of
    # v2-lite-sft-8npu held its AllGather output, [102400, 2048] float32, through the micro-step.
    if group > 1:
        slot["copies"] += local * gathered_bytes(info, precision)
    elif size > precision.compute_bytes and not info.name.endswith("mlp.gate.weight"):
        slot["casts"] += local * precision.compute_bytes


def gathered_bytes(info: ParamInfo, precision: Precision) -> int:
    """Bytes per element of an optimizer-sharded parameter as MindSpore's parallel optimizer all-gathers it: after
    the parameter's cast to the compute dtype, which MindSpore moves ahead of the gather (the compiled IR reads
    ``AllGather(Cast(param))``: ``frontend/parallel/pass/optimize_parallel_allgather_comm.cc``), except for the tables
    read in their own dtype: the embedding (its ``Gather`` reads the table, the cast comes after) and the router
    (``model/router.py`` scores in float32)."""
    size = itemsize(info.dtype)
    if info.name.startswith("model.embed_tokens") or info.name.endswith("mlp.gate.weight"):
        return size
    return min(size, precision.compute_bytes)


# What the quantized layers hold per scale element (model/quant.py, QuantLinear / QuantStackedWeight):
# a float32 weight_scale and a float32 weight_offset (zeros; msModelSlim's W8A16 / W4A16 names), and
# the bytes per element of the weight they dequantise to (float32, the CPU reference path's arithmetic).
SCALE_BYTES = 4 + 4
DEQUANT_BYTES = 4


def _quantized_bytes(slot, info: ParamInfo, layout, local: int, quant: QuantSpec) -> None:
    """One NPU's slice of a quantized weight [.., out, in]: int8 1 byte / int4 half a byte per element;
    scales and offsets [.., out] per output channel or [.., in / g, out] per group, split like the
    weight; the whole slice dequantised once is the workspace (docs/planner.md, "Quantized base")."""
    local_in = info.shape[-1] // layout[-1]  # quant_layout_problems has checked the group divides it
    scales = local // (local_in if quant.group_size is None else quant.group_size)
    slot["weights"] += local * quant.bits / 8
    slot["scales"] += scales * SCALE_BYTES
    slot["dequant"] = max(slot["dequant"], local * DEQUANT_BYTES)


def quant_layout_problems(inventory: List[ParamInfo], plan: Plan, mesh: Mesh, quant: QuantSpec) -> List[str]:
    """A layout that splits a quantized weight's input columns into slices the group size does not
    divide cannot hold its group scales (one line, the first such weight)."""
    if quant.group_size is None:
        return []
    for info in inventory:
        if info.trainable or not is_quantized(info):
            continue
        split = param_layout(plan, info.name, mesh)[-1]
        if (info.shape[-1] // split) % quant.group_size:
            return [
                f"quant.group_size: {quant.group_size} does not divide the {info.shape[-1] // split} input "
                f"columns of {info.name} on one NPU (input width {info.shape[-1]} split {split} ways)"
            ]
    return []


# Float32 images of one parameter live at once in the composite update of a bfloat16 / float16 parameter.
# FITTED, not derived: the largest count MindSpore's level-1 accounting showed (tests/compile/
# test_compile_optimizer.py's toy; fewer on v2-sft-64npu's rank 0: docs/measurements.md, "The update's
# float32 temporaries").
UPDATE_TEMPORARIES = 4


def in_flight(parallel: ParallelConfig, stage: int) -> int:
    """Micro-batches whose activations a stage holds at once under 1F1B."""
    if parallel.pp == 1:
        return 1
    return min(parallel.pp - stage, parallel.micro_batches)


def comm_groups(parallel: ParallelConfig) -> int:
    groups = 1  # world
    groups += parallel.tp > 1
    groups += parallel.dp > 1
    groups += parallel.ep > 1
    groups += parallel.ep > 1 and parallel.dp // parallel.ep > 1
    groups += 2 * (parallel.pp > 1)  # send / receive neighbours
    groups += parallel.dp * parallel.tp > max(parallel.dp, parallel.tp)  # whole stage (replicated params)
    return groups


def stage_memory(
    cfg, parallel: ParallelConfig, w: Workload, precision: Precision, hw: Hardware, held: List[Dict[str, float]]
) -> List[StageMemory]:
    """Per pipeline stage: one NPU's device memory at the training step's peak, by category (and at the
    validation graph's, with ``w.validation``), from the bytes :func:`param_bytes` found it holds (``held``)."""
    c = precision.compute_bytes
    stages = layer_stages(cfg.num_hidden_layers, parallel.pp, parallel.stage_layers)
    result = []
    for s in range(parallel.pp):
        layers = [i for i, st in enumerate(stages) if st == s]
        mem = _one_stage(cfg, parallel, w, c, hw, s, layers, held[s])
        if w.validation:
            mem.eval_peak = _eval_peak(cfg, parallel, w, c, layers, s, mem, held[s])
        result.append(mem)
    return result


def _accumulated(parallel: ParallelConfig, w: Workload) -> int:
    """Micro-batches one optimizer step accumulates on a data-parallel rank."""
    return max(1, w.global_batch_size // max(1, parallel.dp * w.micro_batch_size))


def _one_stage(
    cfg, parallel: ParallelConfig, w: Workload, c: int, hw: Hardware, s: int, layers: List[int], held: Dict[str, float]
) -> StageMemory:
    """Stage ``s`` (its decoder ``layers``, the bytes it holds ``held``) at the training step's peak."""
    activations, working, comm = _live_bytes(cfg, parallel, w, c, s, layers, held)
    k = _accumulated(parallel, w)
    gradients = held["gradients"]
    if parallel.pp == 1 and parallel.accumulation_pass(k) and held.get("frozen_embedding"):
        # a frozen embedding under MindSpore's accumulation pass: its gradient is taken into a whole
        # accu_grads buffer to anchor the pass (train/step.py build_step), then dropped; level 1 of
        # v2-qlora-8npu: accu_grads.model.embed_tokens.weight, [102400, 5120] bfloat16, at the peak
        gradients += held["frozen_embedding"]
    dequant = held.get("dequant", 0.0)
    # Clipping: the global norm's square sums run one gradient at a time with float32
    # accumulation (train/step.py), at most a float32 image of the largest local gradient;
    # activations are freed by then, so it competes with the working set, not with them.
    working = max(working, held["largest_grad"] * 4)
    # The float32 update of weights stored narrower runs one parameter at a time (train/optim.py
    # AdamW._composite) with up to UPDATE_TEMPORARIES float32 images of it live; also after the activations.
    working = max(working, UPDATE_TEMPORARIES * held["largest_composite"] * 4)
    # every layer's copies, also under full recompute: MindSpore's level-1 dump of v2-lite-sft-8npu
    # held each layer's all-gathered weights from its forward to the end of the step (one MoE layer's
    # more at the peak per MoE layer more), not one layer's at a time
    # and every layer's compute-dtype casts of wider, not gathered, weights, also under full recompute: a
    # Cast of a Parameter is never recomputed (MindSpore's step_parallel_utils.cc
    # SetCastForParamNotRecompute); level 1 of v2-lite-sft-8npu kept the expert casts of every MoE layer
    copies = held["copies"] + held.get("casts", 0.0)
    hccl = comm_groups(parallel) * hw.hccl_buffer_mb * 1024**2
    return StageMemory(
        stage=s,
        layers=len(layers),
        weights=held["weights"],
        weight_copies=copies,
        gradients=gradients,
        optimizer=held["optimizer"],
        activations=activations,
        working_set=working,
        comm_buffers=comm,
        hccl_buffers=hccl,
        workspace=hw.workspace_gb * GB,
        scales=held.get("scales", 0.0),
        dequant_workspace=dequant,
        params=int(held["params"]),
    )


def _live_bytes(
    cfg, parallel: ParallelConfig, w: Workload, c: int, s: int, layers: List[int], held: Dict[str, float]
) -> Tuple[float, float, float]:
    """(activations kept, working set, communication buffers) of stage ``s`` at its peak, before the
    clipping and the update, which run after the activations are freed."""
    n = w.micro_batch_size * w.seq_len
    kept = sum(layer_activation_bytes(cfg, i, parallel, w, c, parallel.recompute) for i in layers)
    head_kept = head_activation_bytes(cfg, parallel, w, c) if s == parallel.pp - 1 else 0.0
    kept += head_kept
    working, comm = _layers_working_set(cfg, parallel, w, c, layers)
    if s == 0:
        comm += embedding_reduce_bytes(cfg, parallel, n, c) * in_flight(parallel, 0)
    # micro-batches accumulate in order: the pipeline's 1F1B, MindSpore's accumulation pass in a sharded
    # layout, train/step.py OrderedAccumulation otherwise (one micro-batch's activations at a time)
    activations = kept * in_flight(parallel, s)
    k = _accumulated(parallel, w)
    if parallel.ordered_accumulation(k):
        # OrderedAccumulation (no MindSpore accumulation pass: ParallelConfig.ordered_accumulation, which
        # train/step.py build_step asks too): a DropoutGenMask takes only a shape, so MindSpore generates
        # every micro-batch's LoRA masks at the step's start and holds each until its micro-batch (level 1
        # of v2-lite-lora-1npu, 4 micro-batches: 4 sets of masks per layer, generated before the first forward)
        activations += (k - 1) * sum(lora_dropout_bytes(cfg, i, parallel, w, c, masks_only=True) for i in layers)
        # and so for a quantized base's unpacking, which reads only the Parameters: each later micro-batch's
        # compute-dtype image of every layer's weights (level 1 of v2-lite-qlora-1npu, 2 micro-batches: one
        # bfloat16 Cast per quantized element of the layer, docs/measurements.md)
        activations += (k - 1) * held.get("dequantized", 0.0)
    if s == parallel.pp - 1:
        # The loss's backward runs before any layer's and consumes what the loss kept, so the stage peaks
        # either there (the loss's kept tensors and its backward) or in a layer's backward (without them).
        if head_kept + head_backward_bytes(cfg, parallel, w, c) >= working + comm:
            # the all-to-all buffers are transients of the MoE layers, not live then (level 1: no
            # AlltoAll output among the blocks at v2-lite-sft-8npu's peak)
            working, comm = head_backward_bytes(cfg, parallel, w, c), 0.0
        else:
            # one micro-batch's loss tensors freed (level 1 of v2-qlora-8npu: the [n, V] Exp is gone
            # when the last layer's recomputed backward peaks)
            activations -= head_kept
    return activations, working, comm


def _layers_working_set(cfg, parallel: ParallelConfig, w: Workload, c: int, layers: List[int]) -> Tuple[float, float]:
    """(working set, communication buffers) of a layer's backward on a stage of ``layers``: the activation
    gradients in flight, the MoE layer's temporaries, a recomputed layer, the expert exchanges' buffers."""
    n = w.micro_batch_size * w.seq_len
    full = [layer_activation_bytes(cfg, i, parallel, w, c, "none") for i in layers] or [0.0]
    working = n * cfg.hidden_size * 4 * 4  # activation gradients in flight
    moe_layers = [i for i in layers if cfg.is_moe_layer(i)]
    transient = moe_transient_bytes(cfg, parallel, n, c) if moe_layers else 0.0
    comm = 0.0
    if parallel.recompute != "none":
        # the layer being recomputed and its dispatch's temporaries, one layer at a time (MindSpore replays each
        # layer as its own region: verification/compile/check.py recompute_regions checks the compiled graph);
        # no all-to-all buffers beside them: the transients hold the exchange's two [E, C, H] gradients (level 1
        # of v2-pretrain-256npu, stage 0: no AlltoAll output alive at the MoE layer's backward)
        working += max(full) + transient
    else:
        working += transient
        if cfg.has_moe and parallel.ep > 1 and moe_layers:
            comm += 2 * moe_buffers(cfg, parallel, n)["expert_input"] * c  # all-to-all send + receive
    if moe_layers and parallel.tp > 1 and parallel.ep == 1:
        # experts split by tp: the row-parallel down_proj's output and the column-parallel input gradient are
        # AllReduces of a whole [E, C, H], one live at the MoE backward (level 1 of v2-sft-64npu and
        # v2-lora-16npu, stage 0: one AllReduce output of [E, C, H] at the peak, docs/measurements.md)
        comm += moe_buffers(cfg, parallel, n)["expert_output"] * c
    return working, comm


def _eval_peak(
    cfg,
    parallel: ParallelConfig,
    w: Workload,
    c: int,
    layers: List[int],
    s: int,
    mem: StageMemory,
    held: Dict[str, float],
) -> float:
    """The device at the validation graph's peak: what stays allocated between the graphs (weights,
    their all-gathered / cast copies, gradients, optimizer states, HCCL, workspace) plus one
    micro-batch's forward, one layer at a time (:func:`eval_layer_bytes`), the head's [n, V/tp]
    float32 logits and their exp on the last stage, and the eval AllToAll's send / receive buffers."""
    n = w.micro_batch_size * w.seq_len
    live = max([eval_layer_bytes(cfg, i, parallel, w, c) for i in layers] or [0.0])
    if s == parallel.pp - 1:
        V = cfg.vocab_size / (parallel.tp if parallel.vocab_parallel else 1)
        live = max(live, n * V * 8 + n * cfg.hidden_size * (4 + c))
    comm = 0.0
    if cfg.has_moe and parallel.ep > 1 and any(cfg.is_moe_layer(i) for i in layers):
        comm = 2 * moe_buffers(cfg, parallel, n, training=False)["expert_input"] * c
    static = mem.weights + held["copies"] + mem.gradients + mem.optimizer + mem.hccl_buffers + mem.workspace
    return static + live + comm
