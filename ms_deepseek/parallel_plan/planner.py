"""Planner: does a layout fit in NPU memory, how fast would it run, and which layout is best.

``estimate(cfg, parallel, workload)`` sizes one layout: per-NPU memory of every
pipeline stage (the fullest stage decides ``fits``), the bytes each NPU moves per
step over tp all-reduces, ep all-to-alls, dp gradient sync and pp point-to-point,
and a step time from FLOPs at a realistic fraction of the bf16 peak plus
communication that is not overlapped, stretched by the pipeline bubble
(pp - 1) / (m + pp - 1). ``search`` enumerates dp / tp / pp / ep / micro-batches /
recompute / optimizer sharding / sequence parallel for a device count and ranks
the layouts that fit by tokens/s per NPU. ``check_recipe_fits`` is what
``train`` and ``launch`` call before building anything.

The cost formulas live in :mod:`ms_deepseek.parallel_plan.costs` (memory), :mod:`~ms_deepseek.parallel_plan.activations`
(what a micro-batch keeps) and :mod:`~ms_deepseek.parallel_plan.throughput` (FLOPs, traffic, bandwidth), and in
``docs/planner.md``.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

from ms_deepseek.config.lora import lora_inventory
from ms_deepseek.config.parallel import ParallelConfig
from ms_deepseek.config.quant import group_size_problem
from ms_deepseek.core.dtypes import itemsize
from ms_deepseek.core.errors import UserError
from ms_deepseek.parallel_plan import costs, throughput
from ms_deepseek.parallel_plan.costs import GB, Hardware, StageMemory
from ms_deepseek.parallel_plan.plan import (
    Mesh,
    Plan,
    layer_stages,
    optimizer_shard_group,
    parameter_inventory,
    shard_numel,
    stage_of_param,
)
from ms_deepseek.parallel_plan.validate import layout_problems
from ms_deepseek.parallel_plan.workload import Precision, Workload

TP_CHOICES = (1, 2, 4, 8, 16)
DEFAULT_PLAN = Plan()


@dataclass
class PlanResult:
    layout: ParallelConfig
    workload: Workload
    fits: bool
    problems: List[str]
    stages: List[StageMemory] = field(default_factory=list)
    usable_gb: float = 0.0
    comm_gb: Dict[str, float] = field(default_factory=dict)  # per NPU per step (the slowest stage's)
    stage_comm_gb: List[Dict[str, float]] = field(default_factory=list)  # the same, for each pipeline stage
    comm_minimum_gb: Dict[str, float] = field(default_factory=dict)  # what the layout itself needs (_time)
    time_s: Dict[str, float] = field(default_factory=dict)
    tokens_per_s_per_npu: float = 0.0  # the low end (costs.LOW): the estimate
    tokens_per_s_range: Tuple[float, float] = (0.0, 0.0)  # (low, high) efficiency ends
    mfu_range: Tuple[float, float] = (0.0, 0.0)  # model FLOPs utilisation each end implies
    bubble_fraction: float = 0.0
    grad_accumulation: int = 1
    model: Dict[str, Any] = field(default_factory=dict)

    @property
    def worst(self) -> Optional[StageMemory]:
        return max(self.stages, key=lambda s: s.peak) if self.stages else None

    @property
    def memory_gb(self) -> Dict[str, float]:
        worst = self.worst
        return worst.gb() if worst is not None else {}

    @property
    def eval_note(self) -> Optional[str]:
        """When the validation graph, not the training step, sets the peak: what it needs and the way out."""
        worst = self.worst
        if worst is None or worst.eval_peak <= worst.total:
            return None
        return (
            f"the validation graph sets the peak: {worst.eval_peak / GB:.1f} GB per NPU (stage {worst.stage}; "
            f"the training step {worst.total / GB:.1f} GB), MoE buffers at the eval capacity (dropless "
            "unless model.overrides.eval_capacity_factor)"
        )

    @property
    def peak_gb(self) -> float:
        worst = self.worst
        return worst.peak / GB if worst is not None else float("inf")

    def to_dict(self) -> Dict[str, Any]:
        layout = dataclasses.asdict(self.layout)
        for key in ("reserve_memory", "memory_headroom_gb", "hbm_gb", "force", "dataset_strategy"):
            layout.pop(key, None)
        memory = dict(self.memory_gb)
        if self.worst is not None:
            memory["stage"] = self.worst.stage
        memory["usable"] = round(self.usable_gb, 3)
        workload = dataclasses.asdict(self.workload)
        if self.workload.lora is not None:  # what sizes the adapters (alpha and dropout do not)
            workload["lora"] = self.workload.lora.settings()
        return {
            "fits": self.fits,
            "problems": self.problems,
            "layout": layout,
            "grad_accumulation": self.grad_accumulation,
            "workload": workload,
            "memory_gb": memory,
            "stage_memory_gb": [dict(s.gb(), stage=s.stage, layers=s.layers) for s in self.stages],
            "communication_gb_per_step": {k: round(v, 3) for k, v in self.comm_gb.items()},
            "stage_communication_gb_per_step": [{k: round(v, 4) for k, v in s.items()} for s in self.stage_comm_gb],
            "communication_minimum_gb_per_step": {k: round(v, 3) for k, v in self.comm_minimum_gb.items()},
            "time_s": {k: round(v, 4) for k, v in self.time_s.items()},
            "bubble_fraction": round(self.bubble_fraction, 4),
            "tokens_per_s_per_npu": round(self.tokens_per_s_per_npu, 2),
            "tokens_per_s_per_npu_range": [round(x, 2) for x in self.tokens_per_s_range],
            "mfu_range": [round(x, 4) for x in self.mfu_range],
            "model": self.model,
        }


def default_precision(cfg, compute_dtype: Optional[str] = None) -> Precision:
    dtype = compute_dtype or cfg.compute_dtype
    return Precision(compute_bytes=itemsize(dtype))


def estimate(
    cfg,
    parallel: ParallelConfig,
    workload: Workload,
    precision: Optional[Precision] = None,
    hardware: Optional[Hardware] = None,
    world_size: Optional[int] = None,
    plan: Optional[Plan] = None,
    inventory=None,
) -> PlanResult:
    """Memory, traffic and speed of one layout. Invalid layouts come back with ``problems`` set."""
    precision = precision or default_precision(cfg)
    hw = hardware or Hardware()
    w = workload
    problems = layout_problems(
        parallel,
        cfg,
        seq_len=w.seq_len,
        global_batch_size=w.global_batch_size,
        micro_batch_size=w.micro_batch_size,
        world_size=world_size,
    )
    result = PlanResult(
        layout=parallel,
        workload=w,
        fits=False,
        problems=problems,
        usable_gb=hw.hbm_gb - hw.runtime_reserved_gb,
        model=_model_summary(cfg),
    )
    if problems:
        return result
    inventory = inventory if inventory is not None else parameter_inventory(cfg)
    if w.lora is not None and not any(".lora_A." in i.name for i in inventory):
        inventory = lora_inventory(cfg, w.lora, inventory)
    if w.quant is not None:
        if w.lora is None:
            raise UserError("quant: a quantized base is frozen, so it needs LoRA (a lora: section or --lora-r)")
        problem = group_size_problem(w.quant, inventory)
        if problem:
            raise UserError(problem)
    plan = plan or DEFAULT_PLAN
    if w.quant is not None:
        result.problems = costs.quant_layout_problems(inventory, plan, Mesh.from_parallel(parallel), w.quant)
        if result.problems:
            return result
    held = costs.param_bytes(cfg, parallel, precision, inventory, plan, quant=w.quant)
    result.stages = costs.stage_memory(cfg, parallel, w, precision, hw, held)
    result.fits = result.peak_gb <= result.usable_gb
    _speed(result, held, cfg, precision, hw, plan, inventory)
    return result


_SUMMARIES: Dict[str, Dict[str, Any]] = {}  # one per model config: a search estimates hundreds of layouts of it


def _model_summary(cfg) -> Dict[str, Any]:
    from ms_deepseek.config.inventory import count_parameters

    key = repr(cfg)
    if key not in _SUMMARIES:
        count = count_parameters(cfg)
        if len(_SUMMARIES) > 64:
            _SUMMARIES.clear()
        _SUMMARIES[key] = {
            "total_params_b": round(count.total / 1e9, 3),
            "activated_params_b": round(count.activated / 1e9, 3),
            "layers": cfg.num_hidden_layers,
            "routed_experts": cfg.n_routed_experts or 0,
            "capacity_factor": cfg.capacity_factor,
            "param_dtype": cfg.param_dtype,
        }
    return dict(_SUMMARIES[key])


def _speed(result: PlanResult, held, cfg, precision: Precision, hw: Hardware, plan: Plan, inventory):
    """Step time and tokens/s at both ends of the efficiency range (costs.LOW / costs.HIGH) of
    ``result``'s layout and workload."""
    p, w = result.layout, result.workload
    micro_total = w.global_batch_size // (p.dp * w.micro_batch_size)  # micro-batches per dp rank per step
    result.grad_accumulation = max(1, micro_total // p.micro_batches)
    traffic = _stage_traffic(cfg, p, w, precision, hw, inventory)
    dp_per_stage = dp_sync(cfg, p, precision, hw, plan, inventory, result.grad_accumulation)  # nominal bandwidth
    worst_dp = max(range(p.pp), key=lambda s: dp_per_stage[s][1])  # the stage whose synchronisation takes longest
    dp_bytes, dp_seconds, dp_anchor = dp_per_stage[worst_dp]
    worst_held = max(held, key=lambda h: h["weights"] + h["optimizer"])
    t_opt = 2 * (worst_held["weights"] + worst_held["optimizer"] + worst_held["gradients"]) / (hw.hbm_tbps * 1e12)
    tokens = w.global_batch_size * w.seq_len
    m = p.micro_batches
    result.bubble_fraction = (p.pp - 1) / (m + p.pp - 1) if p.pp > 1 else 0.0
    per_end = {}
    for eff in (hw.low, hw.high):
        t_mb, t_compute, slowest = _slowest_stage(traffic, hw, eff)
        if p.pp > 1:
            t_pipe = result.grad_accumulation * (m + p.pp - 1) * t_mb
        else:
            t_pipe = micro_total * t_mb
        t_dp = dp_seconds / eff.comm
        step = t_pipe + t_dp + t_opt
        per_end[eff.name] = dict(
            step=step,
            compute=t_compute,
            t_mb=t_mb,
            pipe=t_pipe,
            dp=t_dp,
            slowest=slowest,
            tokens=tokens / step / p.world_size,
        )
    low, high = per_end[hw.low.name], per_end[hw.high.name]
    result.time_s = {
        "step": low["step"],
        "step_high": high["step"],
        "compute_per_microbatch": low["compute"],
        "per_microbatch": low["t_mb"],
        "pipeline": low["pipe"],
        "dp_sync": low["dp"],
        "optimizer": t_opt,
    }
    slowest = low["slowest"]
    result.comm_gb = _comm_gb(slowest, dp_bytes, micro_total)
    result.stage_comm_gb = [_comm_gb(st, dp, micro_total) for st, (dp, _, _) in zip(traffic, dp_per_stage)]
    # The layout's minimum: every collective of the layout once per pass that runs it (forward, backward, and the
    # forward's replay under full recompute, which MindSpore replays with the layer), the gradients and parameters
    # synchronised once per step, and nothing else (no anchor gradient for a frozen embedding).
    result.comm_minimum_gb = _comm_gb(slowest, dp_bytes - dp_anchor, micro_total)
    result.tokens_per_s_per_npu = low["tokens"]
    result.tokens_per_s_range = (low["tokens"], high["tokens"])
    flops_per_token = throughput.model_flops_per_token(cfg, w.seq_len, lora=w.lora is not None)
    result.mfu_range = tuple(t * flops_per_token / (hw.peak_tflops * 1e12) for t in result.tokens_per_s_range)


def _slowest_stage(traffic: List[Dict[str, float]], hw: Hardware, eff) -> tuple:
    """(seconds per micro-batch, of which compute, the stage's traffic) of the slowest pipeline stage at
    efficiency ``eff``."""
    per_stage = []
    for st in traffic:
        t_compute = st["flops"] / (hw.peak_tflops * 1e12 * eff.compute)
        t_comm = (st["tp"] / st["bw_tp"] + st["ep"] / st["bw_ep"]) / eff.comm
        t_pp = st["pp"] / st["bw_pp"] / eff.comm
        per_stage.append((t_compute + (1 - eff.overlap) * t_comm + t_pp, t_compute, st))
    return max(per_stage, key=lambda x: x[0])


def _stage_traffic(
    cfg, p: ParallelConfig, w: Workload, precision: Precision, hw: Hardware, inventory
) -> List[Dict[str, float]]:
    """Per pipeline stage and micro-batch: FLOPs executed and bytes sent (tp, ep, pp) with the
    nominal bandwidth of each group."""
    c = precision.compute_bytes
    stages = layer_stages(cfg.num_hidden_layers, p.pp, p.stage_layers)
    n = w.micro_batch_size * w.seq_len
    # Forward passes that repeat the collectives: recompute="full" replays each layer's forward.
    replays = 1 + (p.recompute == "full")
    bw_tp = throughput.group_bandwidth(p.tp, 1, hw)
    bw_ep = throughput.ep_alltoall_bandwidth(p, hw)  # the real expert-parallel groups (ranks.ep_group_of_rank)
    bw_pp = throughput.group_bandwidth(2, p.dp * p.tp, hw)
    out = []
    adapters = throughput.lora_adapter_dims(inventory) if w.lora is not None else {}
    for s in range(p.pp):
        layers = [i for i, st in enumerate(stages) if st == s]
        flops = tp_b = ep_b = 0.0
        for i in layers:
            f, core = throughput.layer_flops(cfg, i, p, w)
            extra = f if p.recompute == "full" else (core if p.recompute == "selective" else 0.0)
            if w.lora is None:
                flops += 3 * f + extra  # forward + backward (2x) + recompute
            else:
                # frozen weights: the backward computes activation gradients but no weight
                # gradients (the attention core has no weights: its backward stays 2x), plus the
                # adapters' forward + backward
                flops += 2 * f + core + extra + throughput.layer_lora_flops(cfg, i, p, w, adapters)
            tp_b += (1 + replays) * throughput.layer_tp_bytes(cfg, i, p, w, c)  # forward(s) + backward
            ep_b += (1 + replays) * throughput.layer_ep_bytes(cfg, i, p, w, c)
        if s == p.pp - 1:
            V = cfg.vocab_size / (p.tp if p.vocab_parallel else 1)
            flops += (3 if w.lora is None else 2) * 2 * n * cfg.hidden_size * V
            if p.tp > 1 and p.vocab_parallel:
                # vocab-parallel loss: all-reduces of the row max, the sum of exp and the target
                # logit ([n] float32 each), forward; the backward needs none
                tp_b += 3 * 2 * (p.tp - 1) / p.tp * n * 4
        if s == 0 and p.tp > 1 and p.vocab_parallel:
            tp_b += 2 * 2 * (p.tp - 1) / p.tp * n * cfg.hidden_size * c  # embedding all-reduce, fwd + bwd
        pp_b = pp_sent = 0.0
        if p.pp > 1:
            sp = p.tp if p.sequence_parallel else 1
            # a stage sends its hidden state forward and its input's gradient back (the first stage only the
            # former, the last only the latter); its time counts what it sends and receives
            pp_sent = n * cfg.hidden_size * c / sp * (2 if 0 < s < p.pp - 1 else 1)
            pp_b = 2 * pp_sent
        out.append(dict(flops=flops, tp=tp_b, ep=ep_b, pp=pp_b, pp_sent=pp_sent, bw_tp=bw_tp, bw_ep=bw_ep, bw_pp=bw_pp))
    return out


def dp_sync(cfg, p: ParallelConfig, precision: Precision, hw: Hardware, plan: Plan, inventory, accum_steps: int = 1):
    """Per pipeline stage, (bytes one NPU sends, seconds at nominal bandwidth, the bytes of those that are an
    anchor) of its gradient and parameter synchronisation per step. A frozen embedding under MindSpore's accumulation
    pass counts too, as the anchor: its gradient is taken to anchor the pass (train/step.py build_step) and
    all-reduced over its replicas once per step before it is dropped; the layout's minimum leaves it out."""
    mesh = Mesh.from_parallel(p)
    stages = layer_stages(cfg.num_hidden_layers, p.pp, p.stage_layers)
    per_stage = [[0.0, 0.0, 0.0] for _ in range(p.pp)]
    anchored = p.pp == 1 and p.accumulation_pass(accum_steps)
    for info in inventory:
        if not info.trainable and not (anchored and info.name.startswith("model.embed_tokens")):
            continue
        layout = costs.param_layout(plan, info.name, mesh)
        split = 1
        for k in layout:
            split *= k
        group = mesh.stage_devices // split
        if group <= 1:
            continue
        local = shard_numel(info.shape, layout)
        grad = local * (precision.grad_bytes or itemsize(info.dtype))
        if (
            p.optimizer_shard
            and info.trainable
            and optimizer_shard_group(info.shape, layout, mesh.stage_devices, itemsize(info.dtype)) > 1
        ):
            # once per step: the accumulated gradient reduce-scattered, the updated slice gathered for the next
            # forward (in the dtype it is gathered in: costs.gathered_bytes). Optimizer level 1
            # (parallel_apply/apply.py auto_parallel_wrap: AutoParallel.hsdp) splits weights and optimizer
            # states, not the accumulated gradients (mindspore/parallel/auto_parallel.py, hsdp), so neither
            # collective repeats per micro-batch; level 2 and 3 would (plan --compile counts what compiles)
            sent = (group - 1) / group * (grad + local * costs.gathered_bytes(info, precision))
        else:
            sent = 2 * (group - 1) / group * grad  # an all-reduce of the gradient
        # Replicas of a tp-split slice sit tp apart; fully replicated ones span the whole stage.
        stride = p.tp if split > 1 or p.tp == 1 else 1
        bw = throughput.group_bandwidth(group, stride, hw)
        s = stage_of_param(info, p.pp, stages)
        per_stage[s][0] += sent
        per_stage[s][1] += sent / bw
        if not info.trainable:
            per_stage[s][2] += sent
    return [tuple(stage) for stage in per_stage]


def _comm_gb(stage: Dict[str, float], dp_bytes: float, micro_total: int) -> Dict[str, float]:
    """GB one NPU of a stage sends per step, per kind: its per-micro-batch tp / ep / pp traffic times the
    micro-batches of a step, and its gradient / parameter synchronisation."""
    return {
        "tp_allreduce": stage["tp"] * micro_total / GB,
        "ep_alltoall": stage["ep"] * micro_total / GB,
        "dp_sync": dp_bytes / GB,
        "pp_p2p": stage["pp_sent"] * micro_total / GB,
    }


# ------------------------------------------------------------------------- calibration
MINDFORMERS_TOKENS_PER_S = 36.0  # research/deepseek2 README, 64 x 910B
PAPER_TOKENS_PER_S = 1e12 / (172.8e3 * 3600)  # 172.8K H800 GPU-hours per 1T tokens: 1,607
# H800 SXM (NVIDIA's datasheet): 989 TFLOPS bf16 dense, HBM at 3.35 TB/s, NVLink 400 GB/s (200 GB/s each way,
# spread over 7 peers through NVSwitch), 8 x 400 Gb/s InfiniBand per node (50 GB/s per GPU).
PAPER_H800 = dict(hbm_gb=80.0, peak_tflops=989.0, hbm_tbps=3.35, hccs_gbps=200.0 / 7, roce_gbps=50.0, npus_per_node=8)


def calibration_anchors() -> Dict[str, Dict[str, Any]]:
    """The two published runs the efficiency ends are fitted on (docs/planner.md, "Efficiencies")."""
    from ms_deepseek.config.model import get_preset

    v2 = get_preset("deepseek-v2", compute_dtype="bfloat16", param_dtype="bfloat16")
    return {
        # MindFormers research/deepseek2 236B fine-tune: dp4 mp8 pp2 ep4, 20 micro-batches, full
        # recompute, optimizer sharding, capacity factor 2, eager attention, seq 4096.
        "low": dict(
            cfg=v2.replace(capacity_factor=2.0),
            layout=ParallelConfig(dp=4, tp=8, pp=2, ep=4, micro_batches=20, recompute="full", optimizer_shard=True),
            workload=Workload(seq_len=4096, global_batch_size=80),
            precision=Precision(),
            hardware={},
            world=64,
            published=MINDFORMERS_TOKENS_PER_S,
        ),
        # DeepSeek-V2 pretraining (paper, section 3.1): 16-way pipeline, 8-way EP, ZeRO-1 DP, no TP,
        # seq 4096, batch 9216 for most of the run, device-level capacity factor 1.0, recompute of
        # norms and MLA up-projections (~selective), fused attention, bf16 with fp32 master weights
        # and gradients. The cluster size is not published: 1,024 GPUs (dp 64) assumed.
        "high": dict(
            cfg=v2.replace(capacity_factor=1.0),
            layout=ParallelConfig(
                dp=64, tp=1, pp=16, ep=8, micro_batches=144, recompute="selective", optimizer_shard=True
            ),
            workload=Workload(seq_len=4096, global_batch_size=9216, flash_attention=True),
            precision=Precision(compute_bytes=2, grad_bytes=4, master_bytes=4),
            hardware=PAPER_H800,
            world=1024,
            published=PAPER_TOKENS_PER_S,
        ),
    }


def anchor_estimate(end: str, compute: Optional[float] = None) -> PlanResult:
    """The planner's estimate of one anchor run (``compute`` overrides that end's compute efficiency)."""
    a = calibration_anchors()[end]
    eff = costs.LOW if end == "low" else costs.HIGH
    if compute is not None:
        eff = dataclasses.replace(eff, compute=compute)
    hw = Hardware(**a["hardware"], low=eff, high=eff)
    return estimate(a["cfg"], a["layout"], a["workload"], a["precision"], hw, world_size=a["world"])


def solve_compute_efficiency(end: str) -> float:
    """The compute efficiency at which the planner reproduces the anchor's published tokens/s
    (bisection; the comm efficiency and overlap of that end are assumptions, see costs.LOW/HIGH)."""
    target = calibration_anchors()[end]["published"]
    lo, hi = 1e-3, 1.0
    for _ in range(50):
        mid = (lo + hi) / 2
        if anchor_estimate(end, mid).tokens_per_s_per_npu < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


# ------------------------------------------------------------------------------ search
def _divisors(n: int) -> List[int]:
    """The divisors of ``n`` in increasing order, in O(sqrt n) steps."""
    small, large, d = [], [], 1
    while d * d <= n:
        if n % d == 0:
            small.append(d)
            if d * d != n:
                large.append(n // d)
        d += 1
    return small + large[::-1]


def candidate_layouts(
    cfg,
    npus: int,
    workload: Workload,
    hw: Hardware,
    recompute=("none", "selective", "full"),
    optimizer_shard=(False, True),
    sequence_parallel=(False, True),
):
    E = cfg.n_routed_experts or 1
    for pp in _divisors(npus):
        if pp > cfg.num_hidden_layers:
            continue
        for tp in TP_CHOICES:
            if (npus // pp) % tp or tp > hw.npus_per_node:
                continue
            dp = npus // (pp * tp)
            if workload.global_batch_size % (dp * workload.micro_batch_size):
                continue
            micro_total = workload.global_batch_size // (dp * workload.micro_batch_size)
            if pp > 1 and micro_total < pp:
                continue
            m = micro_total if pp > 1 else 1
            eps = [e for e in _divisors(dp) if E % e == 0] if cfg.has_moe else [1]
            for ep, rc, opt, sp in itertools.product(eps, recompute, optimizer_shard, sequence_parallel):
                if sp and tp == 1:
                    continue
                yield ParallelConfig(
                    dp=dp, tp=tp, pp=pp, ep=ep, micro_batches=m, recompute=rc, optimizer_shard=opt, sequence_parallel=sp
                )


def search(
    cfg,
    npus: int,
    workload: Workload,
    precision: Optional[Precision] = None,
    hardware: Optional[Hardware] = None,
    top: int = 5,
    progress: bool = False,
    announce: Optional[Callable[[int], None]] = None,
    **choices,
) -> List[PlanResult]:
    """Valid layouts for ``npus`` ranked by fit, then tokens/s per NPU (then lower peak memory).
    ``announce(n)`` is told how many layouts will be estimated before the first one is."""
    precision = precision or default_precision(cfg)
    hardware = hardware or Hardware()
    inventory = parameter_inventory(cfg)
    if workload.lora is not None:
        inventory = lora_inventory(cfg, workload.lora, inventory)
    results = []
    candidates = list(candidate_layouts(cfg, npus, workload, hardware, **choices))
    if announce is not None:
        announce(len(candidates))
    if progress:  # drawn only on a terminal
        from ms_deepseek.core.progress import progress_bar

        candidates = progress_bar(candidates, desc="plan", unit="layout", leave=False)
    for layout in candidates:
        r = estimate(cfg, layout, workload, precision, hardware, world_size=npus, inventory=inventory)
        if not r.problems:
            results.append(r)
    if not results:
        raise UserError(
            f"plan: no valid layout of {npus} NPUs for this model, sequence length "
            f"{workload.seq_len} and global batch {workload.global_batch_size}"
        )
    results.sort(key=lambda r: (not r.fits, -r.tokens_per_s_per_npu if r.fits else r.peak_gb, r.peak_gb))
    return results[:top]


# ------------------------------------------------------------------------ recipe check
def recipe_workload(recipe) -> Workload:
    """Sequence length and batch of a recipe (a loaded ``Recipe`` or any object with the same fields).

    The global batch is ``ParallelConfig.global_batch`` for a ``Recipe`` (the definition ``train``
    uses), else ``train.global_batch_size``.
    """
    parallel, train = recipe.parallel, recipe.train
    seq_len = getattr(recipe.data, "seq_len", None)
    if seq_len is None:
        seq_len = getattr(recipe, "seq_len", None)
    if seq_len is None:
        raise UserError("data.seq_len: required to size activations for the parallel plan")
    mbs = int(getattr(train, "micro_batch_size", 1) or 1)
    if hasattr(train, "grad_accum_steps"):
        global_batch = parallel.global_batch(mbs, int(train.grad_accum_steps))
    else:
        global_batch = int(train.global_batch_size)
    # Eager attention keeps [T, T] scores; the fused Ascend path (model use_flash_attention) does not.
    model_cfg = getattr(recipe, "model_config", None)
    lora = getattr(recipe, "lora", None)
    return Workload(
        seq_len=int(seq_len),
        global_batch_size=global_batch,
        micro_batch_size=mbs,
        flash_attention=bool(getattr(model_cfg, "use_flash_attention", False)),
        lora=lora,
        quant=getattr(recipe, "quant", None),
        validation=getattr(recipe.data, "validation", None) is not None,
    )


def check_recipe_fits(
    recipe,
    model_cfg=None,
    hardware: Optional[Hardware] = None,
    precision: Optional[Precision] = None,
    workload: Optional[Workload] = None,
) -> PlanResult:
    """The planner's verdict on a loaded recipe (``train`` / ``launch`` refuse ``fits=False``
    unless ``--force`` or ``parallel.force``).

    ``recipe`` needs ``parallel`` (ParallelConfig), ``data.seq_len`` (or ``seq_len``), ``train``
    (see :func:`recipe_workload`) and, unless ``model_cfg`` is given, ``model_config``.
    """
    parallel = recipe.parallel
    cfg = model_cfg if model_cfg is not None else getattr(recipe, "model_config", None)
    if cfg is None:
        raise UserError("plan: the recipe's model config is not resolved (pass model_cfg)")
    hw = hardware or Hardware(hbm_gb=parallel.hbm_gb)
    return estimate(
        cfg,
        parallel,
        workload or recipe_workload(recipe),
        precision or default_precision(cfg),
        hw,
        world_size=parallel.world_size,
    )
