"""FLOPs and traffic of one training step on one NPU, and the bandwidth a collective gets: what the planner's
step time is built from (:func:`ms_deepseek.parallel_plan.planner.estimate`; the formulas are written out in
``docs/planner.md``). The expert AllToAll's volume is the dispatch as built
(:func:`ms_deepseek.parallel_plan.activations.moe_buffers`) and its bandwidth that of the real expert-parallel
groups (:func:`ep_alltoall_bandwidth`, from :func:`ms_deepseek.parallel_plan.ranks.ep_group_of_rank`).
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

from ms_deepseek.config.parallel import ParallelConfig
from ms_deepseek.parallel_plan.activations import expert_rows, moe_buffers
from ms_deepseek.parallel_plan.costs import Hardware
from ms_deepseek.parallel_plan.plan import ParamInfo
from ms_deepseek.parallel_plan.ranks import ep_group_of_rank
from ms_deepseek.parallel_plan.workload import Workload


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
        f += 2 * expert_rows(cfg, parallel, n) * 3 * H * I / t  # every capacity slot is computed
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
        rows = expert_rows(cfg, parallel, n) if stacked else n
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
        size += expert_rows(cfg, parallel, n) * cfg.hidden_size * c  # expert down_bmm partial sums
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
    exact = cfg.replace(capacity_factor=1.0, moe_dispatch="capacity") if cfg.has_moe else cfg
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
