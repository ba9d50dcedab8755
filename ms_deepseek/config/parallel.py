"""The recipe's ``parallel:`` section: how one training job is split over NPUs.

Degrees and their meaning (world size = dp * tp * pp):

* ``dp``  data parallel: replicas of each pipeline stage's weights (before optimizer sharding).
* ``tp``  tensor (model) parallel: attention heads, MLP columns and vocabulary split tp ways.
* ``pp``  pipeline parallel: decoder layers cut into pp stages (``stage_layers`` or an even cut).
* ``ep``  expert parallel: routed experts split ep ways. The ep groups are carved out of the
  dp x tp devices of a stage (MindSpore's rule: ep divides dp * tp; MindFormers' MoE
  additionally asks ep <= dp and ep divides dp, enforced by the validator).
* ``micro_batches``: pipeline micro-batches per optimizer step (1F1B); >= pp when pp > 1.

This module only types and checks the section on its own; checks that need the model,
the sequence length or the batch size live in :mod:`ms_deepseek.parallel_plan.validate`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Literal, Optional

from ms_deepseek.config.model import MAX_EXPERTS, MAX_LAYERS
from ms_deepseek.core.errors import UserError
from ms_deepseek.core.schema import MAX_BATCH, MAX_DEVICES, check_at_most

RECOMPUTE_POLICIES = ("none", "selective", "full")


@dataclass
class ParallelConfig:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    micro_batches: int = 1
    # ZeRO-1 style: optimizer states (and the fp32 update) split across the dp replicas
    # (MindSpore's parallel optimizer, ``enable_parallel_optimizer``).
    optimizer_shard: bool = False
    # Norms / dropout / residual activations split on the sequence axis across tp.
    sequence_parallel: bool = False
    # Embedding table and lm_head split on the vocabulary axis across tp (else replicated).
    vocab_parallel: bool = True
    # "none": keep all activations; "selective": recompute attention core and MoE
    # activation functions; "full": keep only each layer's input.
    recompute: Literal["none", "selective", "full"] = "none"
    # How the dataset feeds the devices: "data_parallel" = each dp rank reads its own
    # shard (MindSpore dataset_strategy); "full_batch" = every rank reads the whole batch.
    dataset_strategy: Literal["data_parallel", "full_batch"] = "data_parallel"
    # Decoder layers per pipeline stage (length pp, summing to num_hidden_layers);
    # None = as even a cut as possible (earlier stages take the remainder last).
    stage_layers: Optional[List[int]] = None
    # Custom expert -> EP rank assignment (length n_routed_experts, each rank owning
    # n_routed_experts / ep experts); None = contiguous blocks (expert e on rank e // (E/ep)).
    expert_placement: Optional[List[int]] = None
    # Device memory pool reserved before compile (Ascend): the planner's estimate up front,
    # growing up to hbm_gb minus the runtime and HCCL reserve; a warning when the estimate
    # leaves less than memory_headroom_gb of it. Ignored on CPU.
    reserve_memory: bool = True
    memory_headroom_gb: float = 2.0
    hbm_gb: float = 64.0
    # Let `train` / `launch` run a layout that the planner says cannot fit.
    force: bool = False

    def __post_init__(self):
        for key in ("dp", "tp", "pp", "ep", "micro_batches"):
            value = getattr(self, key)
            if value < 1:
                raise UserError(f"parallel.{key}: must be >= 1, got {value}")
        for key in ("dp", "tp", "pp", "ep"):
            check_at_most(f"parallel.{key}", getattr(self, key), MAX_DEVICES, "NPUs in one job")
        check_at_most("parallel.micro_batches", self.micro_batches, MAX_BATCH, "pipeline micro-batches per step")
        if self.dp * self.tp * self.pp > MAX_DEVICES:
            raise UserError(
                f"parallel: dp x tp x pp = {self.dp * self.tp * self.pp} NPUs, more than {MAX_DEVICES} "
                f"(NPUs in one job)"
            )
        check_at_most("parallel.stage_layers", self.stage_layers, MAX_LAYERS, "decoder layers")
        if self.expert_placement is not None and len(self.expert_placement) > MAX_EXPERTS:
            raise UserError(
                f"parallel.expert_placement: {len(self.expert_placement)} entries, more than "
                f"{MAX_EXPERTS} (routed experts)"
            )
        check_at_most("parallel.hbm_gb", self.hbm_gb, 65536, "GB of one device's memory")
        check_at_most("parallel.memory_headroom_gb", self.memory_headroom_gb, 65536, "GB of one device's memory")
        if self.recompute not in RECOMPUTE_POLICIES:
            raise UserError(
                f"parallel.recompute: must be one of {', '.join(RECOMPUTE_POLICIES)}, got {self.recompute!r}"
            )
        if self.pp > 1 and self.micro_batches < self.pp:
            raise UserError(
                f"parallel.micro_batches: {self.micro_batches} is fewer than pp={self.pp} "
                f"(1F1B needs at least one micro-batch per stage)"
            )
        if self.stage_layers is not None:
            if len(self.stage_layers) != self.pp:
                raise UserError(f"parallel.stage_layers: has {len(self.stage_layers)} entries, expected pp={self.pp}")
            if any(n < 1 for n in self.stage_layers):
                raise UserError(f"parallel.stage_layers: every stage needs >= 1 layer, got {self.stage_layers}")
        if self.memory_headroom_gb < 0:
            raise UserError(f"parallel.memory_headroom_gb: must be >= 0, got {self.memory_headroom_gb}")
        if self.hbm_gb <= 0:
            raise UserError(f"parallel.hbm_gb: must be > 0, got {self.hbm_gb}")

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    def global_batch(self, micro_batch_size: int, grad_accum_steps: int = 1) -> int:
        """Sequences per optimizer step over all data-parallel replicas: dp x micro_batch_size x the
        micro-steps per step, which are the pipeline's micro_batches when pp > 1 (the recipe keeps
        grad_accum_steps at 1 then) and grad_accum_steps otherwise. The one definition used by
        ``train`` (``Recipe.global_batch_size``) and ``plan --recipe`` (``planner.recipe_workload``)."""
        per_replica = self.micro_batches if self.pp > 1 else grad_accum_steps
        return self.dp * int(micro_batch_size) * int(per_replica)

    def accumulation_pass(self, micro_batches: int) -> bool:
        """Whether MindSpore's own pass accumulates the step's ``micro_batches`` (its pipeline pass, or its
        accumulation pass under SEMI/AUTO parallel): ``train.step.build_step`` and the planner both ask here."""
        return self.pp > 1 or (self.uses_semi_auto and micro_batches > 1)

    def ordered_accumulation(self, micro_batches: int) -> bool:
        """Whether the step accumulates in our own ``train.step.OrderedAccumulation`` (several micro-batches and no
        MindSpore pass to order them: one NPU, plain data parallel, CPU)."""
        return micro_batches > 1 and not self.accumulation_pass(micro_batches)

    @property
    def uses_semi_auto(self) -> bool:
        """Anything beyond plain data parallel needs MindSpore's SEMI_AUTO_PARALLEL mode."""
        return self.tp > 1 or self.pp > 1 or self.ep > 1 or self.optimizer_shard

    def describe(self) -> str:
        extras = []
        if self.optimizer_shard:
            extras.append("opt-shard")
        if self.sequence_parallel:
            extras.append("seq-par")
        return f"dp{self.dp} tp{self.tp} pp{self.pp} ep{self.ep} mb{self.micro_batches} recompute={self.recompute}" + (
            " " + " ".join(extras) if extras else ""
        )
