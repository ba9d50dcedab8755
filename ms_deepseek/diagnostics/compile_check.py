"""``plan --recipe R --compile``: MindSpore's own compiler on a recipe's sharded graphs, on any machine.

For each selected rank a worker process (:mod:`ms_deepseek.diagnostics.compile_worker`) runs under
MindSpore's dry run (``MS_SIMULATION_LEVEL=0``: compile only; ``RANK_SIZE`` / ``RANK_ID`` of the
recipe's world; ``device_target`` Ascend) and compiles the training step and the validation graph
exactly as ``train`` builds them on the cluster, at full width and reduced depth. It needs no NPU,
no weights and no data; on a host without CANN the libraries MindSpore's Ascend plugin links
against are stubs (:mod:`ms_deepseek.diagnostics.cann_stubs`).

Per rank and graph it reports: compiled or not (MindSpore's first error line and the first line of
our source), the compiled-layout check against the plan, the communication operators MindSpore
inserted (from the IR it dumps after its ``validate`` pass: the graph as it will run, slice shapes),
compile seconds and peak host memory. Workers run one after another: a compile at full width takes
several GB of host memory.

What a compile proves: MindSpore's parallel frontend accepts every strategy, layout, redistribution,
the pipeline and accumulation passes, and lays the parameters out as the plan says. What it does
not: Ascend kernels (ours and CANN's), HCCL, speed. Device memory: ``plan --compile --memory`` runs the
workers at ``MS_SIMULATION_LEVEL=1`` instead (the step runs once without kernels and MindSpore accounts
its memory pool; :mod:`ms_deepseek.diagnostics.memory_check`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

from ms_deepseek.core.errors import UserError
from ms_deepseek.diagnostics import traffic
from ms_deepseek.diagnostics.ir_rules import (
    LARGE_CONSTANT_MB,
    HeadShape,
    gathered_heads,
    global_norm_reduced,
    ir_dump_env,
    ir_files,
    joined_recompute_regions,
    large_constants,
)

# a full-width compile of one rank takes minutes; a hung compile is stopped
WORKER_TIMEOUT_S = 1800


# ---------------------------------------------------------------------------------- rank choice
def default_ranks(dp: int, tp: int, pp: int) -> List[int]:
    """The first rank of every pipeline stage and the last rank of the world."""
    stage = dp * tp
    ranks = [s * stage for s in range(pp)] + [pp * stage - 1]
    return sorted(set(ranks))


def parse_ranks(spec: str, world: int, default: Sequence[int]) -> List[int]:
    """``default`` / ``all`` / ``last`` / a comma list of ranks and ranges (``0,7``, ``0-3,15``)."""
    text = spec.strip().lower()
    if text in ("", "default"):
        return list(default)
    if text == "all":
        return list(range(world))
    if text == "last":
        return [world - 1]
    ranks = set()
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if not m:
            raise UserError(f"--ranks: {part.strip()!r} is not a rank or a range (e.g. 0,7 or 0-3; or all, last)")
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if lo > hi or hi >= world:
            raise UserError(f"--ranks: {part.strip()!r} is outside the world of {world} ranks (0-{world - 1})")
        ranks.update(range(lo, hi + 1))
    return sorted(ranks)


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


# ---------------------------------------------------------------------------------- running
@dataclass
class RankResult:
    rank: int
    stage: Optional[int] = None
    graphs: Dict[str, Dict] = field(default_factory=dict)
    seconds: float = 0.0
    peak_rss_mb: float = 0.0
    log: Optional[str] = None

    @property
    def ok(self) -> bool:
        return bool(self.graphs) and all(g.get("ok") for g in self.graphs.values())


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
        from ms_deepseek.diagnostics.cann_stubs import ensure_stubs

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


@dataclass
class RankJob:
    """What a rank's compile worker is given, the same for every rank of one compile: the recipe as the worker
    builds it (:meth:`~ms_deepseek.config.recipe.Recipe.to_request`: the loaded recipe and its overrides), the
    world size, the CANN install (None: stubs), the folder that holds each rank's request, log and result,
    whether the validation graph is compiled too, the seconds a worker may take, ``memory``: the
    process runs at ``MS_SIMULATION_LEVEL=1`` (the step runs once without kernels and ``graphs["step"]["memory"]``
    holds MindSpore's accounting, :mod:`ms_deepseek.diagnostics.memory_check`), ``heads``: the attention's
    per-head shape, to refuse a graph that gathers the heads (:func:`gathered_heads`), and ``par``: the layout,
    to sort each communication operator to the axis it serves (``traffic.by_axis``)."""

    recipe: Dict[str, Any]
    world: int
    cann: Optional[str]
    work: Path
    eval_graph: bool = True
    timeout: float = WORKER_TIMEOUT_S
    memory: bool = False
    heads: Optional[HeadShape] = None
    par: Any = None


def run_rank(job: RankJob, rank: int) -> RankResult:
    """Compile one rank in its own process; its folder under ``job.work`` holds request, log and result."""
    folder = job.work / f"rank_{rank:05d}"
    folder.mkdir(parents=True, exist_ok=True)
    request = folder / "request.json"
    request.write_text(
        json.dumps(
            {
                "recipe": job.recipe,
                "eval": job.eval_graph,
                "memory": job.memory,
            }
        )
    )
    ir_dir = folder / "ir"
    env, _ = compile_environment(rank, job.world, job.cann, ir_dir, level=1 if job.memory else 0)
    log = folder / "worker.log"
    start = time.time()
    failed = _launch(job, request, folder, env, log)
    result_file = folder / "result.json"
    if failed is None and not result_file.is_file():
        tail = log.read_text(errors="replace").strip().splitlines()[-3:]
        failed = "the worker died: " + " | ".join(tail)
    if failed is not None:
        return RankResult(
            rank,
            graphs={"setup": {"ok": False, "error": failed, "where": ""}},
            seconds=time.time() - start,
            log=str(log),
        )
    data = json.loads(result_file.read_text())
    result = RankResult(
        rank,
        data.get("stage"),
        data.get("graphs", {}),
        data.get("seconds", 0.0),
        data.get("peak_rss_mb", 0.0),
        str(log),
    )
    if job.memory and result.graphs.get("step", {}).get("ok"):
        from ms_deepseek.diagnostics.memory_check import read_accounting

        result.graphs["step"]["memory"] = read_accounting(log, folder / f"rank_{rank}")
        return result
    compiled = [g for g in ("train", "eval") if result.graphs.get(g, {}).get("ok")]
    for name, path in zip(compiled, ir_files(ir_dir)):
        _check_ir(result.graphs[name], name, path, job, rank)
    shutil.rmtree(ir_dir, ignore_errors=True)  # large; the counts are kept
    return result


def _launch(job: RankJob, request: Path, folder: Path, env: Dict[str, str], log: Path) -> Optional[str]:
    """Run the compile worker on ``request``, its output into ``log``; why it gave no answer in time, else None."""
    with open(log, "wb") as out:
        try:
            subprocess.run(
                [sys.executable, "-m", "ms_deepseek.diagnostics.compile_worker", str(request)],
                cwd=folder,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=job.timeout,
            )
        except subprocess.TimeoutExpired:
            return f"no answer after {job.timeout:.0f} s (stopped)"
    return None


def _check_ir(graph: Dict, name: str, path: Path, job: RankJob, rank: int) -> None:
    """The compiled graph ``name``'s communication from its validate IR at ``path``, and the IR's rules: a graph
    that holds a large constant, gathers the attention's heads or joins layers' recompute regions is refused."""
    ops = traffic.read_ops(path)
    graph["communication"] = traffic.by_kind(ops)
    if job.par is not None:
        graph["traffic"] = traffic.by_axis(ops, rank, job.par)
    constants = large_constants(path)
    if constants:
        big = constants[0]
        more = f"; {len(constants) - 1} more over {LARGE_CONSTANT_MB:.0f} MiB" if len(constants) > 1 else ""
        _refuse(
            graph,
            large_constants=constants,
            error=f"MindSpore folded a constant of {big['shape']} {big['dtype']} ({big['mb']:.0f} MiB, used in "
            f"{big['uses']} places{more}) into the graph: it would be held on the device all run "
            "(build it at run time, from a tensor)",
        )
    heads = job.heads
    gathered = gathered_heads(path, heads) if heads is not None else []
    if gathered and graph.get("ok"):
        g = gathered[0]
        _refuse(
            graph,
            gathered_heads=gathered,
            error=f"MindSpore computes attention tensors of all {heads.heads} heads on each of the {heads.tp} "
            f"tensor-parallel ranks: {g['op']} {g['shape']} at {g['scope']} (an operation on a per-head "
            "tensor without the plan's strategy; name it and give it one: model/mla.py)",
        )
    joined = joined_recompute_regions(path) if name == "train" else []
    if joined and graph.get("ok"):
        _refuse(
            graph,
            joined_recompute_regions=joined,
            error=f"MindSpore recomputes layers {joined[0]['layers']} as one region ({len(joined)} such regions): "
            "it replays them together at the start of the backward and holds each replay until its own "
            "layer's backward (an operator shared by the layers' recomputed cells joins them; "
            "diagnostics/compile_check.py recompute_regions)",
        )
    if name == "train" and job.world > 1:
        graph["global_norm_allreduce"] = global_norm_reduced(path)


def _refuse(graph: Dict, error: str, **found) -> None:
    """Mark a compiled graph as failed by one of the IR's rules, with what the rule found."""
    graph.update(ok=False, error=error, where="", **found)


@dataclass
class CompileReport:
    recipe: str
    world: int
    layout: str
    reduction: Reduction
    provider: str
    ranks: List[RankResult]

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.ranks)

    def price_traffic(self, stage_comm_gb: List[Dict[str, float]]) -> None:
        """Set each compiled training step's traffic beside the planner's for the rank's stage (the planner run on
        the same reduced model: ``stage_communication_gb_per_step``), as ``traffic_vs_planner``."""
        for r in self.ranks:
            train = r.graphs.get("train", {})
            if train.get("ok") and "traffic" in train and stage_comm_gb:
                stage = min(r.stage or 0, len(stage_comm_gb) - 1)
                train["traffic_vs_planner"] = traffic.against_planner(train["traffic"], stage_comm_gb[stage])

    @property
    def traffic_agrees(self) -> bool:
        """Whether the planner prices every compiled step's traffic within ``traffic.TOLERANCE`` per axis."""
        rows = [row for r in self.ranks for row in r.graphs.get("train", {}).get("traffic_vs_planner", [])]
        return all(row["ok"] for row in rows)

    def to_dict(self) -> Dict:
        return {
            "recipe": self.recipe,
            "world_size": self.world,
            "layout": self.layout,
            "layers": self.reduction.layers,
            "stage_layers": self.reduction.stage_layers,
            "full_layers": self.reduction.full_layers,
            "micro_batches": self.reduction.micro_batches,
            "micro_batches_kind": self.reduction.what,
            "full_micro_batches": self.reduction.full_micro_batches,
            "ascend_libraries": self.provider,
            "compiled": self.ok,
            "ranks": [
                {
                    "rank": r.rank,
                    "stage": r.stage,
                    "ok": r.ok,
                    "seconds": r.seconds,
                    "peak_rss_mb": r.peak_rss_mb,
                    "graphs": r.graphs,
                }
                for r in self.ranks
            ],
        }


@dataclass(frozen=True)
class CompileSetup:
    """How :func:`compile_recipe` runs its workers: the CANN install (None: stubs), the folder for each rank's
    request, log and result (None: a temporary one, removed when every rank compiled), whether the validation
    graph is compiled too, whether each step runs at MindSpore's level 1 (``memory``: :class:`RankJob`), and
    where progress lines go (None: nowhere)."""

    cann: Optional[str] = None
    work: Optional[Path] = None
    eval_graph: bool = True
    memory: bool = False
    progress: Optional[Callable[[str], None]] = None


def compile_recipe(
    recipe,
    ranks: List[int],
    reduction: Reduction,
    setup: CompileSetup = CompileSetup(),
) -> CompileReport:
    """Compile ``recipe`` (loaded with its overrides; its ``parallel`` section may hold layout flags applied after
    loading) for ``ranks`` at ``reduction``'s depth and micro-batches."""
    par = recipe.parallel
    world = par.world_size
    # the recipe every worker builds, built once here: a refusal (e.g. --pp 2 on a recipe that accumulates)
    # is one UserError line before any compile, not the same line from every worker
    compiled_recipe = recipe.with_overrides(layout_overrides(par) + reduction.overrides())
    heads = HeadShape.of(compiled_recipe.model_config, par.tp, compiled_recipe.data.seq_len)
    memory = setup.memory
    _, provider = compile_environment(0, world, setup.cann, Path(tempfile.gettempdir()), level=1 if memory else 0)
    own = setup.work is None
    work = Path(tempfile.mkdtemp(prefix="ms-deepseek-compile-")) if own else Path(setup.work)
    job = RankJob(
        compiled_recipe.to_request(), world, setup.cann, work, setup.eval_graph, memory=memory, heads=heads, par=par
    )
    results = []
    try:
        for rank in ranks:
            if setup.progress is not None:
                setup.progress(
                    f"compiling rank {rank} of {world}{' and running its step (level 1)' if memory else ''}: "
                    f"{reduction.describe()} ..."
                )
            results.append(run_rank(job, rank))
    finally:
        if own and all(r.ok for r in results) and len(results) == len(ranks):
            shutil.rmtree(work, ignore_errors=True)  # kept when something failed: the logs are there
    return CompileReport(recipe.source_path, world, par.describe(), reduction, provider, results)


def _comm_text(comm: Dict[str, Dict[str, float]]) -> str:
    if not comm:
        return "none"
    return ", ".join(f"{k} {v['count']} ({v['mb']:.0f} MB)" for k, v in sorted(comm.items()))


def format_report(report: CompileReport) -> str:
    lines = [
        f"compile {report.recipe}: {report.layout}, world {report.world}; {report.reduction.describe()}",
        f"  MindSpore dry run (MS_SIMULATION_LEVEL=0), {report.provider}",
    ]
    for r in report.ranks:
        head = f"  rank {r.rank}" + (f" (stage {r.stage})" if r.stage is not None else "")
        for name, g in r.graphs.items():
            if g.get("ok"):
                check = (
                    f"layouts match the plan ({g['layouts_compared']} parameters, "
                    f"{g.get('strategies_compared', 0)} primitive strategies)"
                    if g.get("layouts_compared")
                    else ""
                )
                lines.append(
                    f"{head} {name}: compiled in {g.get('seconds', 0):.0f} s, peak host memory "
                    f"{g.get('peak_rss_mb', 0) / 1024:.1f} GB" + (f"; {check}" if check else "")
                )
                if "traffic_vs_planner" in g:
                    lines += traffic.format_axes(g["traffic"], g["traffic_vs_planner"], "      ")
                elif "communication" in g:
                    lines.append(f"      communication per step: {_comm_text(g['communication'])}")
                if "global_norm_allreduce" in g:
                    lines.append(
                        "      gradient norm: "
                        + (
                            "all-reduced across the slices (PARALLEL_GLOBALNORM)"
                            if g["global_norm_allreduce"]
                            else "NOT all-reduced: each rank would clip by its own norm"
                        )
                    )
            else:
                lines.append(f"{head} {name}: FAILED: {g.get('error', '')}")
                if g.get("where"):
                    lines.append(f"      at {g['where']}")
                if r.log:
                    lines.append(f"      log: {r.log}")
            head = " " * len(head)
    lines.append("all compiled; the layouts match the plan" if report.ok else "not compiled: see above")
    if report.ok and not report.traffic_agrees:
        lines.append(
            f"  the planner's traffic differs from the compiled step's by more than {traffic.TOLERANCE:.0%} (marked "
            "above): its step time and tokens/s do not describe this program"
        )
    lines.append("  (a compile does not prove kernels, HCCL, device memory at run time or speed)")
    return "\n".join(lines)
