"""Per-NPU cost model of one training step: bytes held, bytes moved, FLOPs.

Pure Python, no MindSpore. The formulas are written out in ``docs/planner.md``;
names here follow that document. Everything is per NPU and per micro-batch unless
the name says otherwise. ``n`` = tokens of one micro-batch on one data-parallel
rank (micro_batch_size * seq_len); tp ranks see the same n tokens.

The MoE buffers and the expert AllToAll volume are not a formula of their own: they are
read from :func:`ms_deepseek.config.dispatch_shapes.dispatch_buffers`, the shapes the MoE
layer builds (capacity per data-parallel rank, [G, E, C, H] dispatch / combine buffers,
[dp/ep, E, ep*C, H] expert input split (dp/ep, ep, 1, 1)). The AllToAll's bandwidth is that of the
real expert-parallel groups (:func:`ep_alltoall_bandwidth`, from :func:`ms_deepseek.parallel_plan.ranks.ep_group_of_rank`).

Principled terms and fitted constants. Every byte count is principled: shapes times dtype sizes, with
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
from typing import Dict, List, Optional, Sequence, Tuple

from ms_deepseek.config.dispatch_shapes import dispatch_buffers
from ms_deepseek.config.lora import LoraSpec, targeted
from ms_deepseek.config.parallel import ParallelConfig
from ms_deepseek.config.quant import QuantSpec, is_quantized
from ms_deepseek.core.dtypes import itemsize
from ms_deepseek.core.errors import UserError
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
from ms_deepseek.parallel_plan.ranks import ep_group_of_rank

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


@dataclass
class Precision:
    """Bytes per element. ``grad_bytes`` None: gradients in each parameter's own dtype (MindSpore)."""

    compute_bytes: int = 2  # activations (bfloat16 on Ascend)
    grad_bytes: Optional[int] = None
    optimizer_bytes: int = 8  # AdamW m and v in float32 (train.optim.AdamW)
    master_bytes: int = 0  # extra float32 master copy (0: parameters are updated in place)
    optimizer_level: str = "level1"  # MindSpore parallel optimizer: level1 shards weights + states,
    # level2/level3 also gradients


@dataclass
class Workload:
    seq_len: int
    global_batch_size: int
    micro_batch_size: int = 1
    flash_attention: bool = False  # True: fused attention (FlashAttentionScore) keeps no [T, T] scores
    lora: Optional[LoraSpec] = None  # None: full fine-tuning / pretraining
    quant: Optional[QuantSpec] = None  # a quantized frozen base under LoRA (None: the base in param_dtype)
    validation: bool = False  # data.validation: the eval graph's peak counts too (eval_peak)


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
    out = [
        dict(
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
        for _ in range(parallel.pp)
    ]
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
    return out


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


_MOE_BUFFERS: Dict[tuple, Dict[str, float]] = {}  # the planner asks the same layer shape for every layer


def moe_buffers(cfg, parallel: ParallelConfig, n: int, training: bool = True) -> Dict[str, float]:
    """Elements one NPU holds in one MoE layer's forward for one micro-batch, from the dispatch as
    built (``dispatch_buffers``; n = tokens per data-parallel rank), and one AllToAll's elements.
    ``training`` False: at the evaluation capacity (``eval_capacity_factor``; None = dropless, C = n).
    Memoised on what the dispatch reads (a search asks it hundreds of thousands of times)."""
    key = (
        cfg.n_routed_experts,
        cfg.num_experts_per_tok,
        cfg.hidden_size,
        cfg.moe_intermediate_size,
        cfg.capacity_factor,
        getattr(cfg, "eval_capacity_factor", None),
        parallel.dp,
        parallel.ep,
        parallel.tp,
        int(n),
        bool(training),
    )
    found = _MOE_BUFFERS.get(key)
    if found is None:
        built = dispatch_buffers(cfg, parallel.dp, parallel.ep, parallel.tp, n, training=training)
        found = {name: float(b["elements_per_device"]) for name, b in built["buffers"].items()}
        found["alltoall"] = float(built["alltoall_elements_per_device"])
        found["capacity"] = float(built["capacity"])
        if len(_MOE_BUFFERS) > 65536:
            _MOE_BUFFERS.clear()
        _MOE_BUFFERS[key] = found
    return dict(found)


def _expert_rows(cfg, parallel: ParallelConfig, n: int) -> float:
    """Rows of the expert input [E, G*C, H] one NPU computes: (E/ep) x (ep*C) = E*C."""
    return moe_buffers(cfg, parallel, n)["expert_input"] / cfg.hidden_size


def moe_transient_bytes(cfg, parallel: ParallelConfig, n: int, c: int) -> float:
    """Peak bytes of one MoE layer's temporaries that are not kept for backward.

    Forward: the float32 sort keys of the slot assignment with the sorted copy and its indices
    (3 x slot_keys x 4). Backward: the float32 gradient of the combined outputs, two
    [E, C, H] gradients live across an AllToAll (send and receive), and the three expert-hidden
    gradients (gate, up, product).
    """
    b = moe_buffers(cfg, parallel, n)
    forward = 3 * b["slot_keys"] * 4
    backward = b["combined"] * 4 + 2 * b["expert_output"] * c + 3 * b["expert_hidden"] * c
    return max(forward, backward)


def lora_dropout_bytes(cfg, i: int, parallel: ParallelConfig, w: Workload, c: int, masks_only: bool = False) -> float:
    """Bytes the LoRA dropout adds to what :func:`layer_activation_bytes` keeps of layer ``i``, for one
    micro-batch on one NPU, without recompute (``masks_only``: under recompute, see below).

    On the NPU each adapter's dropout is MindSpore's ``nn.Dropout`` (``train/lora_run.py``): a
    ``DropoutGenMask`` bit mask (one bit per element) and a ``DropoutDoMask`` output in the compute dtype,
    both kept for the backward (``lora_A``'s gradient reads the dropped input). Projections that share an
    input each drop it with their own mask, so a shared input is kept once per adapted projection; the
    frozen base needs no copy of its own (its weight takes no gradient). The layer's count already holds
    each input once, so each group adds its adapted projections' masks and its copies beyond the first.
    Principled (shapes only); MindSpore's level-1 dump of ``v2-lite-lora-8npu`` agrees to the MiB
    (docs/measurements.md, "LoRA dropout").

    Under recompute MindSpore replays the ``DropoutDoMask`` but never the mask (``recompute_helper.cc``
    ``CanNotRecomputed`` lists ``DropoutGenMask``), so a recomputed layer keeps its masks (level 1 of
    ``v2-qlora-8npu`` under full recompute: docs/measurements.md, "LoRA dropout").
    """
    lora = w.lora
    if lora is None or lora.dropout <= 0:
        return 0.0
    n = w.micro_batch_size * w.seq_len
    t = parallel.tp
    H = cfg.hidden_size
    layer = f"model.layers.{i}"
    q = "q_proj" if cfg.q_lora_rank is None else "q_a_proj"
    # groups of projections that read one input: (module paths, elements of that input on one NPU)
    attention = [
        ([f"{layer}.self_attn.{q}", f"{layer}.self_attn.kv_a_proj_with_mqa"], n * H),
        ([f"{layer}.self_attn.kv_b_proj"], n * cfg.kv_lora_rank),
        ([f"{layer}.self_attn.o_proj"], n * cfg.num_attention_heads * cfg.v_head_dim / t),
    ]
    if cfg.q_lora_rank is not None:
        attention.append(([f"{layer}.self_attn.q_b_proj"], n * cfg.q_lora_rank))
    mlp = f"{layer}.mlp"
    if cfg.is_moe_layer(i):
        rows = _expert_rows(cfg, parallel, n)
        feed = [
            ([f"{mlp}.experts.gate_proj", f"{mlp}.experts.up_proj"], rows * H),
            ([f"{mlp}.experts.down_proj"], moe_buffers(cfg, parallel, n)["expert_hidden"]),
        ]
        if cfg.n_shared_experts:
            shared = f"{mlp}.shared_experts"
            feed.append(([f"{shared}.gate_proj", f"{shared}.up_proj"], n * H))
            feed.append(([f"{shared}.down_proj"], n * cfg.moe_intermediate_size * cfg.n_shared_experts / t))
    else:
        feed = [
            ([f"{mlp}.gate_proj", f"{mlp}.up_proj"], n * H),
            ([f"{mlp}.down_proj"], n * cfg.intermediate_size / t),
        ]
    extra = 0.0
    for modules, elements in attention + feed:
        adapted = sum(1 for m in modules if targeted(m, lora.target_modules))
        if adapted:
            extra += adapted * elements / 8 + (0 if masks_only else (adapted - 1) * elements * c)
    return extra


def layer_activation_bytes(
    cfg, i: int, parallel: ParallelConfig, w: Workload, c: int, policy: str, training: bool = True
) -> float:
    """Bytes one decoder layer keeps for backward, for one micro-batch on one NPU (``training``
    False: the same tensors at the evaluation capacity, see :func:`eval_layer_bytes`)."""
    n = w.micro_batch_size * w.seq_len
    t = parallel.tp
    sp = t if parallel.sequence_parallel else 1
    H = cfg.hidden_size
    if policy == "full":
        kept = n * H * c / sp  # the layer input (the segment is the whole layer: parallel_apply.apply)
        return kept + (lora_dropout_bytes(cfg, i, parallel, w, c, masks_only=True) if training else 0.0)
    nh, qk, v, rope = cfg.num_attention_heads / t, cfg.qk_head_dim, cfg.v_head_dim, cfg.qk_rope_head_dim
    norm = lambda d, div=1: n * d * (4 + c) / div  # noqa: E731  float32 input + normed output
    a = norm(H, sp)  # input_layernorm
    if cfg.q_lora_rank is not None:
        a += norm(cfg.q_lora_rank)
    a += norm(cfg.kv_lora_rank) + n * rope * c  # latent norm, k_pe before rotary
    a += n * nh * (2 * qk + 2 * v + rope) * c  # q, k, v for the score / value matmuls, o_proj input, q_pe
    scores = w.micro_batch_size * nh * w.seq_len * w.seq_len
    if w.flash_attention:
        a += scores / w.seq_len * 8  # FlashAttentionScore keeps max and sum per row
    elif policy == "selective":
        a += scores * (4 + c)  # softmax input (float32) and probs; exp is replayed
    else:
        a += scores * (8 + c)  # float32 scores and exp, probs in compute dtype
    a += norm(H, sp)  # post_attention_layernorm
    if cfg.is_moe_layer(i):
        E, I = cfg.n_routed_experts, cfg.moe_intermediate_size
        a += n * (4 * H + 8 * E)  # float32 router input, scores / softmax
        b = moe_buffers(cfg, parallel, n, training)  # the dispatch as built, per device
        a += b["expert_input"] * c  # expert inputs (after the AllToAll), for the weight grads
        a += 4 * b["expert_hidden"] * c  # gate, up, silu(gate), product
        a += b["combined"] * 4  # float32 combined outputs, for the routing-weight grad
        a += (b["topk_ids"] + b["combine_index"] + b["dispatch_index"]) * 4  # int32 gather indices
        if cfg.n_shared_experts:
            a += 4 * n * c * I * cfg.n_shared_experts / t
    else:
        a += 4 * n * c * cfg.intermediate_size / t
    if training:
        a += lora_dropout_bytes(cfg, i, parallel, w, c)
    return a


def eval_layer_bytes(cfg, i: int, parallel: ParallelConfig, w: Workload, c: int) -> float:
    """Peak bytes of one decoder layer's forward in the validation graph (nothing is kept for a
    backward, so only the layer being run is live): every tensor the layer creates, as
    :func:`layer_activation_bytes` counts them without recompute, at the evaluation capacity, plus
    for an MoE layer the dispatch and combine buffers [G, E, C, H], the expert output and the
    float32 sort keys (three copies). Dropless evaluation (C = n) makes these E*n*H per device,
    the term that can exceed the training step."""
    a = layer_activation_bytes(cfg, i, parallel, w, c, "none", training=False)
    if cfg.is_moe_layer(i):
        n = w.micro_batch_size * w.seq_len
        b = moe_buffers(cfg, parallel, n, training=False)
        a += (b["dispatch_buffer"] + b["expert_output"] + b["combine_buffer"]) * c + 3 * b["slot_keys"] * 4
    return a


def vocab_split(parallel: ParallelConfig) -> int:
    """How many ways the loss's vocabulary axis is split (the plan's ``vocab_cross_entropy`` style)."""
    return parallel.tp if parallel.vocab_parallel else 1


def head_activation_bytes(cfg, parallel: ParallelConfig, w: Workload, c: int) -> float:
    """Final norm, head input and the loss's [n, V/tp] float32 tensors kept for backward. On a whole
    vocabulary (model/loss.py: the target logit by GatherD) only exp(logits - max): MindSpore's level-1
    accounting of v2-lite-lora-1npu (``plan --compile --memory``) held one [n, V] float32 Exp per
    micro-batch in backward and nothing else of the loss's forward. On a split vocabulary also the logits
    and the one-hot slice (MindFormers' CrossEntropyLoss pattern; not measured: no such recipe compiles)."""
    n = w.micro_batch_size * w.seq_len
    V = cfg.vocab_size / vocab_split(parallel)
    return n * (cfg.hidden_size * (4 + 2 * c) + V * (12 if vocab_split(parallel) > 1 else 4))


def head_backward_bytes(cfg, parallel: ParallelConfig, w: Workload, c: int) -> float:
    """The loss's backward at its peak, besides the kept Exp: three [n, V/tp] float32 tensors at once
    (MindSpore's level-1 per-block dump of v2-lite-lora-1npu: the ReduceSum gradient's Tile, the Exp
    gradient's Mul and the GatherD gradient), then the logits' gradient cast to the compute dtype."""
    n = w.micro_batch_size * w.seq_len
    V = cfg.vocab_size / vocab_split(parallel)
    return n * V * max(12, 4 + c)


# Float32 images of one parameter live at once in the composite update of a bfloat16 / float16 parameter.
# FITTED, not derived: the largest count MindSpore's level-1 accounting showed (tests/compile/
# test_compile_optimizer.py's toy; fewer on v2-sft-64npu's rank 0: docs/measurements.md, "The update's
# float32 temporaries").
UPDATE_TEMPORARIES = 4


def embedding_reduce_bytes(cfg, parallel: ParallelConfig, n: int, c: int) -> float:
    """The embedding's all-reduced output kept per micro-batch, beyond the layers' activations.

    A vocabulary split by tp makes each rank's embedding a partial sum, which MindSpore completes with an
    AllReduce of the whole [n, H]. Under sequence parallelism the first layer takes its [n/tp, H] slice, and
    MindSpore keeps the whole AllReduce output from each micro-batch's forward to its backward, one per
    micro-batch in flight (level 1 of v2-sft-64npu's rank 0: docs/measurements.md). Without sequence parallelism the AllReduce output is the first layer's input, counted
    with its activations."""
    if not (parallel.sequence_parallel and parallel.tp > 1 and parallel.vocab_parallel):
        return 0.0
    return float(n * cfg.hidden_size * c)


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
    c = precision.compute_bytes
    counts = [0] * parallel.pp
    stages = layer_stages(cfg.num_hidden_layers, parallel.pp, parallel.stage_layers)
    for s in stages:
        counts[s] += 1
    n = w.micro_batch_size * w.seq_len
    result = []
    for s in range(parallel.pp):
        layers = [i for i, st in enumerate(stages) if st == s]
        kept = sum(layer_activation_bytes(cfg, i, parallel, w, c, parallel.recompute) for i in layers)
        head_kept = head_activation_bytes(cfg, parallel, w, c) if s == parallel.pp - 1 else 0.0
        kept += head_kept
        full = [layer_activation_bytes(cfg, i, parallel, w, c, "none") for i in layers] or [0.0]
        working = n * cfg.hidden_size * 4 * 4  # activation gradients in flight
        moe_layers = [i for i in layers if cfg.is_moe_layer(i)]
        transient = moe_transient_bytes(cfg, parallel, n, c) if moe_layers else 0.0
        comm = 0.0
        if parallel.recompute != "none":
            # the layer being recomputed and its dispatch's temporaries, one layer at a time (MindSpore replays each
            # layer as its own region: diagnostics/compile_check.py recompute_regions checks the compiled graph);
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
        if s == 0:
            comm += embedding_reduce_bytes(cfg, parallel, n, c) * in_flight(parallel, 0)
        # micro-batches accumulate in order: the pipeline's 1F1B, MindSpore's accumulation pass in a sharded
        # layout, train/step.py OrderedAccumulation otherwise (one micro-batch's activations at a time)
        activations = kept * in_flight(parallel, s)
        k = max(1, w.global_batch_size // max(1, parallel.dp * w.micro_batch_size))
        if parallel.ordered_accumulation(k):
            # OrderedAccumulation (no MindSpore accumulation pass: ParallelConfig.ordered_accumulation, which
            # train/step.py build_step asks too): a DropoutGenMask takes only a shape, so MindSpore generates
            # every micro-batch's LoRA masks at the step's start and holds each until its micro-batch (level 1
            # of v2-lite-lora-1npu, 4 micro-batches: 4 sets of masks per layer, generated before the first forward)
            activations += (k - 1) * sum(lora_dropout_bytes(cfg, i, parallel, w, c, masks_only=True) for i in layers)
            # and so for a quantized base's unpacking, which reads only the Parameters: each later micro-batch's
            # compute-dtype image of every layer's weights (level 1 of v2-lite-qlora-1npu, 2 micro-batches: one
            # bfloat16 Cast per quantized element of the layer, docs/measurements.md)
            activations += (k - 1) * held[s].get("dequantized", 0.0)
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
        gradients = held[s]["gradients"]
        if parallel.pp == 1 and parallel.accumulation_pass(k) and held[s].get("frozen_embedding"):
            # a frozen embedding under MindSpore's accumulation pass: its gradient is taken into a whole
            # accu_grads buffer to anchor the pass (train/step.py build_step), then dropped; level 1 of
            # v2-qlora-8npu: accu_grads.model.embed_tokens.weight, [102400, 5120] bfloat16, at the peak
            gradients += held[s]["frozen_embedding"]
        dequant = held[s].get("dequant", 0.0)
        # Clipping: the global norm's square sums run one gradient at a time with float32
        # accumulation (train/step.py), at most a float32 image of the largest local gradient;
        # activations are freed by then, so it competes with the working set, not with them.
        working = max(working, held[s]["largest_grad"] * 4)
        # The float32 update of weights stored narrower runs one parameter at a time (train/optim.py
        # AdamW._composite) with up to UPDATE_TEMPORARIES float32 images of it live; also after the activations.
        working = max(working, UPDATE_TEMPORARIES * held[s]["largest_composite"] * 4)
        # every layer's copies, also under full recompute: MindSpore's level-1 dump of v2-lite-sft-8npu
        # held each layer's all-gathered weights from its forward to the end of the step (one MoE layer's
        # more at the peak per MoE layer more), not one layer's at a time
        # and every layer's compute-dtype casts of wider, not gathered, weights, also under full recompute: a
        # Cast of a Parameter is never recomputed (MindSpore's step_parallel_utils.cc
        # SetCastForParamNotRecompute); level 1 of v2-lite-sft-8npu kept the expert casts of every MoE layer
        copies = held[s]["copies"] + held[s].get("casts", 0.0)
        hccl = comm_groups(parallel) * hw.hccl_buffer_mb * 1024**2
        mem = StageMemory(
            stage=s,
            layers=len(layers),
            weights=held[s]["weights"],
            weight_copies=copies,
            gradients=gradients,
            optimizer=held[s]["optimizer"],
            activations=activations,
            working_set=working,
            comm_buffers=comm,
            hccl_buffers=hccl,
            workspace=hw.workspace_gb * GB,
            scales=held[s].get("scales", 0.0),
            dequant_workspace=dequant,
            params=int(held[s]["params"]),
        )
        if w.validation:
            mem.eval_peak = _eval_peak(cfg, parallel, w, c, layers, s, mem, held[s])
        result.append(mem)
    return result


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


# ------------------------------------------------------------------------ FLOPs and traffic
def layer_flops(cfg, i: int, parallel: ParallelConfig, w: Workload) -> Tuple[float, float]:
    """(forward FLOPs of one micro-batch of layer i on one NPU, of which attention core)."""
    n = w.micro_batch_size * w.seq_len
    t = parallel.tp
    H, nh = cfg.hidden_size, cfg.num_attention_heads / t
    f = 0.0
    if cfg.q_lora_rank is None:
        f += 2 * n * H * nh * cfg.qk_head_dim
    else:
        f += 2 * n * H * cfg.q_lora_rank + 2 * n * cfg.q_lora_rank * nh * cfg.qk_head_dim
    f += 2 * n * H * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    f += 2 * n * cfg.kv_lora_rank * nh * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    f += 2 * n * nh * cfg.v_head_dim * H
    pairs = w.seq_len * w.seq_len / (2 if w.flash_attention else 1)  # flash skips masked blocks
    core = 2 * w.micro_batch_size * nh * pairs * (cfg.qk_head_dim + cfg.v_head_dim)
    f += core
    if cfg.is_moe_layer(i):
        I = cfg.moe_intermediate_size
        f += 2 * n * H * cfg.n_routed_experts  # router
        f += 2 * _expert_rows(cfg, parallel, n) * 3 * H * I / t  # every capacity slot is computed
        f += 2 * n * 3 * H * I * (cfg.n_shared_experts or 0) / t
    else:
        f += 2 * n * 3 * H * cfg.intermediate_size / t
    return f, core


def lora_adapter_dims(adapters: List[ParamInfo]) -> Dict[int, List[Tuple[bool, int, int, int]]]:
    """Decoder layer -> [(stacked over experts, r, in, out)] of its adapters."""
    shapes = {a.name: a.shape for a in adapters if ".lora_" in a.name}
    out: Dict[int, List[Tuple[bool, int, int, int]]] = {}
    for name, shape in shapes.items():
        if not name.endswith(".lora_A.weight"):
            continue
        layer = int(name.split(".")[2]) if name.startswith("model.layers.") else -1
        b = shapes[name.replace(".lora_A.", ".lora_B.")]
        out.setdefault(layer, []).append((len(shape) == 3, shape[-2], shape[-1], b[-2]))
    return out


def layer_lora_flops(
    cfg, i: int, parallel: ParallelConfig, w: Workload, dims: Dict[int, List[Tuple[bool, int, int, int]]]
) -> float:
    """Forward + backward (3x) FLOPs of layer i's adapters on one NPU for one micro-batch: each
    row passes A then B (2*r*(in+out)); a stacked routed-expert adapter sees the expert rows this
    NPU computes (every capacity slot, E*C); a tp share of each."""
    n = w.micro_batch_size * w.seq_len
    f = 0.0
    for stacked, r, in_f, out_f in dims.get(i, ()):
        rows = _expert_rows(cfg, parallel, n) if stacked else n
        f += 2 * rows * r * (in_f + out_f) / parallel.tp
    return 3 * f


def layer_tp_bytes(cfg, i: int, parallel: ParallelConfig, w: Workload, c: int) -> float:
    """Bytes one NPU sends in tp all-reduces for one forward of layer i (ring: 2(t-1)/t x size)."""
    t = parallel.tp
    if t == 1:
        return 0.0
    n = w.micro_batch_size * w.seq_len
    size = n * cfg.hidden_size * c * 2  # o_proj + MLP / shared-expert down_proj
    if cfg.is_moe_layer(i):
        size += _expert_rows(cfg, parallel, n) * cfg.hidden_size * c  # expert down_bmm partial sums
    return 2 * (t - 1) / t * size


def layer_ep_bytes(cfg, i: int, parallel: ParallelConfig, w: Workload, c: int) -> float:
    """Bytes one NPU sends in the dispatch + combine all-to-alls for one forward of layer i."""
    if not cfg.is_moe_layer(i) or parallel.ep == 1:
        return 0.0
    n = w.micro_batch_size * w.seq_len
    return 2 * moe_buffers(cfg, parallel, n)["alltoall"] * c  # dispatch + combine exchanges


def model_flops_per_token(cfg, seq_len: int, lora: bool = False) -> float:
    """Training FLOPs per token of the model itself, the MFU numerator: forward + backward (3x)
    of every matmul a token activates (k routed experts, no capacity padding, no recompute) and
    of causal attention (half the score matrix), on one device. Under LoRA the frozen weights
    get no weight gradient: 2x for their matmuls (the adapters' own FLOPs are left out)."""
    exact = cfg.replace(capacity_factor=1.0) if cfg.has_moe else cfg
    w = Workload(seq_len=seq_len, global_batch_size=1, micro_batch_size=1, flash_attention=True)
    p = ParallelConfig()
    f = core = 0.0
    for i in range(cfg.num_hidden_layers):
        layer, attention = layer_flops(exact, i, p, w)
        f += layer
        core += attention
    f += 2 * seq_len * cfg.hidden_size * cfg.vocab_size  # lm_head
    return ((2 * f + core) if lora else 3 * f) / seq_len


def group_bandwidth(size: int, stride: int, hw: Hardware) -> float:
    """Bytes/s one NPU can send inside a collective over ``size`` ranks spaced ``stride`` apart."""
    if size <= 1:
        return float("inf")
    if size * stride <= hw.npus_per_node:
        return hw.hccs_gbps * 1e9 * (size - 1)  # full mesh: one HCCS link per peer
    return hw.roce_gbps * 1e9


def ranks_bandwidth(group: Sequence[int], hw: Hardware) -> float:
    """Bytes/s one NPU can send inside a collective over the global ranks ``group``: the HCCS full mesh
    when they share a node (one link per peer), else RoCE."""
    if len(group) <= 1:
        return float("inf")
    if len({r // hw.npus_per_node for r in group}) == 1:
        return hw.hccs_gbps * 1e9 * (len(group) - 1)
    return hw.roce_gbps * 1e9


def ep_alltoall_bandwidth(par, hw: Hardware) -> float:
    """The MoE AllToAll's bandwidth: the slowest expert-parallel group of a stage, the groups from the one
    rank rule the model's exchange view, the plan and the simulation share (:func:`ranks.ep_group_of_rank`)."""
    if par.ep == 1:  # no expert parallelism: no AllToAll (and no walk over the ranks)
        return float("inf")
    return min(ranks_bandwidth(ep_group_of_rank(r, par), hw) for r in range(par.dp * par.tp))
