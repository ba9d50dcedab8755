"""Bytes one micro-batch's tensors take on one NPU: what a decoder layer and the loss head keep for the backward,
the MoE layer's dispatch buffers and temporaries, the LoRA dropout's masks and copies, the validation graph's
layer at its peak. ``n`` = tokens of one micro-batch on one data-parallel rank (micro_batch_size * seq_len).
The stage's peak built from them is :func:`ms_deepseek.parallel_plan.costs.stage_memory`; the formulas are
written out in ``docs/planner.md``.

The MoE buffers are not a formula of their own: they are read from
:func:`ms_deepseek.config.dispatch_shapes.dispatch_buffers`, the shapes the MoE layer builds (capacity per
data-parallel rank, [G, E, C, H] dispatch / combine buffers, [dp/ep, E, ep*C, H] expert input split
(dp/ep, ep, 1, 1)).
"""

from __future__ import annotations

from typing import Dict

from ms_deepseek.config.dispatch_shapes import dispatch_buffers
from ms_deepseek.config.lora import targeted
from ms_deepseek.config.parallel import ParallelConfig
from ms_deepseek.parallel_plan.workload import Workload

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
        getattr(cfg, "moe_dispatch", "capacity"),
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


def expert_rows(cfg, parallel: ParallelConfig, n: int) -> float:
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
        rows = expert_rows(cfg, parallel, n)
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
