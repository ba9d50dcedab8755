"""Checks a parallel layout against the model, sequence and batch before anything is built.

Every rule yields one line naming the recipe field and the numbers, e.g.
``parallel.tp: num_attention_heads=128 is not divisible by tp=3``.
:func:`layout_problems` lists them all (the planner uses it to filter candidate
layouts); :func:`validate_layout` raises the first as a UserError.
"""

from __future__ import annotations

from typing import List, Optional

from ms_deepseek.config.model import check_model_size
from ms_deepseek.config.parallel import ParallelConfig
from ms_deepseek.core.errors import UserError
from ms_deepseek.parallel_plan.placement import placement_table


def layout_problems(
    parallel: ParallelConfig,
    cfg,
    *,
    seq_len: Optional[int] = None,
    global_batch_size: Optional[int] = None,
    micro_batch_size: int = 1,
    world_size: Optional[int] = None,
) -> List[str]:
    p = parallel
    out: List[str] = []

    # --- devices
    if world_size is not None and world_size != p.world_size:
        out.append(f"parallel: world size {world_size} != dp*tp*pp = {p.dp}*{p.tp}*{p.pp} = {p.world_size}")
    out += _tensor_parallel_problems(p, cfg)
    out += _expert_parallel_problems(p, cfg)

    # --- pipeline
    L = cfg.num_hidden_layers
    if p.pp > L:
        out.append(f"parallel.pp: num_hidden_layers={L} cannot be split into pp={p.pp} stages")
    if p.stage_layers is not None and sum(p.stage_layers) != L:
        out.append(
            f"parallel.stage_layers: {p.stage_layers} sums to {sum(p.stage_layers)}, expected num_hidden_layers={L}"
        )

    # --- sequence parallel
    if p.sequence_parallel and seq_len is not None and seq_len % p.tp:
        out.append(f"parallel.sequence_parallel: seq_len={seq_len} is not divisible by tp={p.tp}")

    # --- batch
    if global_batch_size is not None:
        out += _batch_problems(p, global_batch_size, micro_batch_size)
    out += _device_count_problems(p)
    return out


def _tensor_parallel_problems(p: ParallelConfig, cfg) -> List[str]:
    """Tensor parallel: every split axis must divide."""
    out: List[str] = []
    tp = p.tp
    if cfg.num_attention_heads % tp:
        out.append(f"parallel.tp: num_attention_heads={cfg.num_attention_heads} is not divisible by tp={tp}")
    if p.vocab_parallel and cfg.vocab_size % tp:
        out.append(
            f"parallel.tp: vocab_size={cfg.vocab_size} is not divisible by tp={tp} "
            f"(or set parallel.vocab_parallel: false)"
        )
    check_model_size(cfg)
    dense_layers = [i for i in range(cfg.num_hidden_layers) if not cfg.is_moe_layer(i)]
    if dense_layers and cfg.intermediate_size % tp:
        out.append(f"parallel.tp: intermediate_size={cfg.intermediate_size} is not divisible by tp={tp}")
    if cfg.has_moe and cfg.moe_intermediate_size % tp:
        out.append(f"parallel.tp: moe_intermediate_size={cfg.moe_intermediate_size} is not divisible by tp={tp}")
    return out


def _expert_parallel_problems(p: ParallelConfig, cfg) -> List[str]:
    dp, tp, ep = p.dp, p.tp, p.ep
    if not cfg.has_moe:
        return [f"parallel.ep: the model has no routed experts, so ep must be 1, got ep={ep}"] if ep > 1 else []
    out: List[str] = []
    E = cfg.n_routed_experts
    if E % ep:
        out.append(f"parallel.ep: n_routed_experts={E} is not divisible by ep={ep}")
    if (dp * tp) % ep:
        out.append(
            f"parallel.ep: ep={ep} does not divide dp*tp = {dp}*{tp} = {dp * tp} "
            f"(expert groups are carved out of one pipeline stage's devices)"
        )
    elif dp % ep:
        out.append(
            f"parallel.ep: ep={ep} does not divide dp={dp} (MindSpore/MindFormers expert "
            f"parallelism splits the data-parallel ranks into ep groups; tp splits each expert)"
        )
    if cfg.topk_method == "group_limited_greedy" and ep > 1 and cfg.n_group:
        G = cfg.n_group
        if G % ep and ep % G:
            out.append(
                f"parallel.ep: group-limited routing maps n_group={G} expert groups to devices; "
                f"ep={ep} must divide n_group or be a multiple of it"
            )
    if p.expert_placement is not None and E % ep == 0:
        try:
            placement_table(E, ep, p.expert_placement)
        except UserError as exc:
            out.append(str(exc))
    return out


def _batch_problems(p: ParallelConfig, global_batch_size: int, micro_batch_size: int) -> List[str]:
    unit = p.global_batch(micro_batch_size)  # one micro-step's worth (pipeline micro-batches only when pp > 1)
    if global_batch_size % unit == 0:
        return []
    what = "dp*micro_batch_size*micro_batches" if p.pp > 1 else "dp*micro_batch_size"
    parts = f"{p.dp}*{micro_batch_size}*{p.micro_batches}" if p.pp > 1 else f"{p.dp}*{micro_batch_size}"
    return [f"train.global_batch_size: {global_batch_size} is not divisible by {what} = {parts} = {unit}"]


def _device_count_problems(p: ParallelConfig) -> List[str]:
    """Devices of a sharded layout (checked last: a specific rule names the cause first).
    MindSpore's SEMI_AUTO_PARALLEL initialises only on 1, 2 or 4 devices or a multiple of 8
    (frontend/parallel/device_manager.cc CheckDeviceConfig: "device_num' must be divisible by 8, or
    equal to 1, 2 or 4"; HCCL's CheckDevCount has the same rule). The compile check of a dp=3 layout
    stopped there ("Parallel init failed"). Plain data parallel (no sharding) does not use that mode."""
    world = p.world_size
    if p.uses_semi_auto and not (world in (1, 2, 4) or world % 8 == 0):
        return [
            f"parallel: a sharded layout needs 1, 2 or 4 devices or a multiple of 8 (MindSpore's "
            f"semi-auto parallel), got dp*tp*pp = {p.dp}*{p.tp}*{p.pp} = {world}"
        ]
    return []


def validate_layout(
    parallel: ParallelConfig,
    cfg,
    *,
    seq_len: Optional[int] = None,
    global_batch_size: Optional[int] = None,
    micro_batch_size: int = 1,
    world_size: Optional[int] = None,
) -> None:
    """Raise UserError with the first problem of the layout (see :func:`layout_problems`)."""
    problems = layout_problems(
        parallel,
        cfg,
        seq_len=seq_len,
        global_batch_size=global_batch_size,
        micro_batch_size=micro_batch_size,
        world_size=world_size,
    )
    if problems:
        raise UserError(problems[0])
