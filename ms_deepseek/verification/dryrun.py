"""The dry run both checks share: the reduced model a rank compiles, the parallel section it is given, and the
environment of one simulated rank.

``plan --compile`` (:mod:`ms_deepseek.verification.compile`) and ``plan --execute``
(:mod:`ms_deepseek.verification.execute`) run MindSpore's dry run (``MS_SIMULATION_LEVEL``) on the same
reduced recipe: :class:`Reduction` (depth and micro-batches that fit a small host), :func:`layout_overrides`
(the exact parallel section as ``--set`` strings) and :func:`compile_environment` (the simulated rank's
variables, with CANN or its stubs, :mod:`ms_deepseek.verification.cann_stubs`).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

from ms_deepseek.core.errors import UserError


# ------------------------------------------------------------------------------ reduced model
@dataclass
class Reduction:
    layers: int
    full_layers: int
    micro_batches: int
    full_micro_batches: int
    what: str  # "micro_batches" (pipeline) or "grad_accum_steps"
    pp: int = 1
    dense_layers: int = 0  # the model's first dense layers (first_k_dense_replace; 0 without MoE)

    @property
    def stage_layers(self) -> Optional[List[int]]:
        """Layers per pipeline stage of the reduced model: the dense layers on stage 0 and the MoE layers
        spread evenly, so that every stage compiles an MoE layer and one more layer per stage (the second
        depth of ``plan --compile --memory``) adds one MoE layer to each. An even cut would leave stage 0
        with the dense layer alone at one layer per stage, and its second depth would add the stage's
        first MoE layer with the layer's one-off buffers, not a per-layer cost. None: no pipeline, or too
        few layers for an MoE layer per stage (the even cut)."""
        moe = self.layers - self.dense_layers
        if self.pp == 1 or moe < self.pp:
            return None
        per, extra = divmod(moe, self.pp)
        # the later stages take the extra ones, as the even cut does (parallel_plan.plan.stage_layer_counts)
        counts = [per + (s >= self.pp - extra) for s in range(self.pp)]
        counts[0] += self.dense_layers
        return counts

    def overrides(self) -> List[str]:
        sets = [f"model.overrides.num_hidden_layers={self.layers}", stage_layers_setting(self.stage_layers)]
        key = "parallel.micro_batches" if self.what == "micro_batches" else "train.grad_accum_steps"
        return sets + [f"{key}={self.micro_batches}"]

    def describe(self) -> str:
        split = self.stage_layers
        return (
            f"{self.layers} of {self.full_layers} layers"
            + (f" (stages {'+'.join(map(str, split))})" if split else "")
            + f", {self.micro_batches} of {self.full_micro_batches} "
            f"{'pipeline micro-batches' if self.what == 'micro_batches' else 'accumulation steps'}"
        )


def stage_layers_setting(split: Optional[List[int]]) -> str:
    """The --set string for a reduced model's cut (None: the even cut)."""
    return "parallel.stage_layers=" + ("null" if split is None else "[" + ",".join(map(str, split)) + "]")


def default_reduction(
    recipe, layers: Optional[int] = None, micro_batches: Optional[int] = None, moe_per_stage: int = 1
) -> Reduction:
    """Depth and micro-batches whose compile fits a small host (the CI machine's). Depth: the first dense layers and ``moe_per_stage`` MoE
    layers per pipeline stage (:attr:`Reduction.stage_layers`), at least two MoE layers (identical layers compile
    differently from one: a Reshape that sharding propagation could not cost once there were two MoE layers
    went unseen at one). The memory check asks for two per stage: with one MoE layer after the dense one, stage 0
    of a pipeline peaked elsewhere than with two or more (level 1 of v2-lora-16npu, docs/measurements.md).
    Micro-batches: one per stage and one more with pipeline parallelism (1F1B needs one per
    stage; the one more gives every stage a forward after its first backward, the steady state of a recipe's
    many micro-batches: with exactly pp, stage 0's last forward came before its first backward, and MindSpore
    freed the forward-only blocks, such as an optimizer-sharded embedding's gathered table, before the backward
    peak that the recipe's steady state reaches with them), else two accumulation steps (the accumulation passes
    run, the graph stays small).
    A compile's host memory grows with layers x micro-batches (docs/measurements.md, "Host memory of the
    compile check")."""
    cfg, par = recipe.model_config, recipe.parallel
    full_layers = cfg.num_hidden_layers
    dense = min(cfg.first_k_dense_replace, full_layers) if cfg.has_moe else 0
    if layers is None:
        per_stage = moe_per_stage if cfg.has_moe else 1
        layers = min(full_layers, max(par.pp * per_stage + dense, min(2, full_layers), dense + 2 if cfg.has_moe else 1))
    if layers < par.pp:
        raise UserError(f"--layers: {layers} is fewer than the {par.pp} pipeline stages (one layer per stage at least)")
    if layers > full_layers:
        raise UserError(f"--layers: {layers} is more than the model's {full_layers} layers")
    if par.pp > 1:
        full_mb, what = par.micro_batches, "micro_batches"
        mb = micro_batches if micro_batches is not None else min(full_mb, par.pp + 1)
        if mb < par.pp:
            raise UserError(f"--micro-batches: {mb} is fewer than the {par.pp} pipeline stages")
    else:
        full_mb, what = recipe.train.grad_accum_steps, "grad_accum_steps"
        mb = micro_batches if micro_batches is not None else min(full_mb, 2)
    return Reduction(layers, full_layers, mb, full_mb, what, pp=par.pp, dense_layers=dense)


def layout_overrides(par) -> List[str]:
    """The --set strings that give a worker this exact parallel section (plan's --dp/--tp/... applied)."""
    out = [f"parallel.{k}={getattr(par, k)}" for k in ("dp", "tp", "pp", "ep", "micro_batches")]
    out += [
        f"parallel.{k}={str(getattr(par, k)).lower()}"
        for k in ("optimizer_shard", "sequence_parallel", "vocab_parallel")
    ]
    out += [f"parallel.recompute={par.recompute}", f"parallel.dataset_strategy={par.dataset_strategy}"]
    if par.expert_placement is None:
        out.append("parallel.expert_placement=null")
    return out


def compile_environment(rank: int, world: int, cann: Optional[str], ir_dir: Path, base_env=None, level: int = 0):
    """(environment, how the Ascend libraries are provided) for one simulated rank at dry-run ``level`` (0: compile
    only; 1: compile and run one step without kernels, with MindSpore's memory accounting)."""
    env = dict(os.environ if base_env is None else base_env)
    how = ""
    if cann:
        root = Path(cann)
        if not root.is_dir():
            raise UserError(
                f"--cann: {cann} is not a folder (CANN's install, e.g. /usr/local/Ascend/ascend-toolkit/latest)"
            )
        libs = [str(p) for p in (root / "lib64", root / "compiler" / "lib64", root / "runtime" / "lib64") if p.is_dir()]
        env["LD_LIBRARY_PATH"] = os.pathsep.join(libs + [env.get("LD_LIBRARY_PATH", "")])
        env["ASCEND_HOME_PATH"] = str(root)
        how = f"CANN at {root}"
    else:
        from ms_deepseek.verification.cann_stubs import ensure_stubs

        stubs = ensure_stubs(level=level)
        env = stubs.env(env)
        how = (
            f"CANN stubs ({len(stubs.missing)} libraries, {stubs.symbols} symbols"
            f"{', built now' if stubs.built else ''}) in {stubs.folder}"
        )
    env.update(
        {
            "MS_SIMULATION_LEVEL": str(level),
            "RANK_SIZE": str(world),
            "RANK_ID": str(rank),
            "MS_DEEPSEEK_DEVICE": "Ascend",
        }
    )
    if level == 0:
        env.update(ir_dump_env(ir_dir))
        env.setdefault("GLOG_v", "3")
    else:
        # MindSpore prints its pool's peak at WARNING level when the process ends (ascend_dynamic_mem_adapter.cc
        # AscendDynamicMemAdapter::DevMemStatistics: "Used peak memory usage (without fragments): NM"); the
        # memory tracker writes every block to rank_<id>/memory_block.csv in the working folder
        # (MS_ALLOC_CONF=memory_tracker:True, mem_pool/mem_tracker.cc)
        env["GLOG_v"] = "2"
        env["MS_ALLOC_CONF"] = "memory_tracker:True"
    for key in ("MS_WORKER_NUM", "MS_ROLE", "MS_SCHED_HOST", "MS_SCHED_PORT"):  # not an msrun worker
        env.pop(key, None)
    return env, how


def ir_dump_env(ir_dir: Path) -> Dict[str, str]:
    """The environment that has MindSpore dump the graph after its ``validate`` pass (what it will run, this
    rank's slice shapes) into ``ir_dir``: what :mod:`ms_deepseek.verification.compile.ir_rules` and
    :mod:`~ms_deepseek.verification.compile.traffic` read."""
    return {"MS_DEV_SAVE_GRAPHS": "1", "MS_DEV_DUMP_IR_PASSES": "validate", "MS_DEV_SAVE_GRAPHS_PATH": str(ir_dir)}


def _dump_index(path: Path) -> int:
    """MindSpore numbers its IR dumps in order (``20_validate_0903.ir``): the train graph's comes first."""
    m = re.search(r"(\d+)\.ir$", path.name)
    return int(m.group(1)) if m else 0


def ir_files(ir_dir: Path) -> List[Path]:
    return sorted(ir_dir.rglob("*validate*.ir"), key=_dump_index)
