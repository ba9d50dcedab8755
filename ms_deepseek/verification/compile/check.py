"""``plan --recipe R --compile``: MindSpore's own compiler on a recipe's sharded graphs, on any machine.

For each selected rank a worker process (:mod:`ms_deepseek.verification.compile.worker`) runs under
MindSpore's dry run (``MS_SIMULATION_LEVEL=0``: compile only; ``RANK_SIZE`` / ``RANK_ID`` of the
recipe's world; ``device_target`` Ascend) and compiles the training step and the validation graph
exactly as ``train`` builds them on the cluster, at full width and reduced depth. It needs no NPU,
no weights and no data; on a host without CANN the libraries MindSpore's Ascend plugin links
against are stubs (:mod:`ms_deepseek.verification.cann_stubs`).

Per rank and graph it reports: compiled or not (MindSpore's first error line and the first line of
our source), the compiled-layout check against the plan, the communication operators MindSpore
inserted (from the IR it dumps after its ``validate`` pass: the graph as it will run, slice shapes),
compile seconds and peak host memory. Workers run one after another: a compile at full width takes
several GB of host memory.

What a compile proves: MindSpore's parallel frontend accepts every strategy, layout, redistribution,
the pipeline and accumulation passes, and lays the parameters out as the plan says. What it does
not: Ascend kernels (ours and CANN's), HCCL, speed. Device memory: ``plan --compile --memory`` runs the
workers at ``MS_SIMULATION_LEVEL=1`` instead (the step runs once without kernels and MindSpore accounts
its memory pool; :mod:`ms_deepseek.verification.compile.memory_accounting`).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, TextIO

from ms_deepseek.core.errors import UserError
from ms_deepseek.core.progress import progress_line
from ms_deepseek.verification.compile import traffic
from ms_deepseek.verification.compile.ir_rules import (
    LARGE_CONSTANT_MB,
    HeadShape,
    gathered_heads,
    global_norm_reduced,
    joined_recompute_regions,
    large_constants,
)
from ms_deepseek.verification.dryrun import Reduction, compile_environment, ir_files, layout_overrides

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


@dataclass
class RankJob:
    """What a rank's compile worker is given, the same for every rank of one compile: the recipe as the worker
    builds it (:meth:`~ms_deepseek.config.recipe.Recipe.to_request`: the loaded recipe and its overrides), the
    world size, the CANN install (None: stubs), the folder that holds each rank's request, log and result,
    whether the validation graph is compiled too, the seconds a worker may take, ``memory``: the
    process runs at ``MS_SIMULATION_LEVEL=1`` (the step runs once without kernels and ``graphs["step"]["memory"]``
    holds MindSpore's accounting, :mod:`ms_deepseek.verification.compile.memory_accounting`), ``heads``: the attention's
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
        from ms_deepseek.verification.compile.memory_accounting import read_accounting

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
                [sys.executable, "-m", "ms_deepseek.verification.compile.worker", str(request)],
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
            "verification/compile/check.py recompute_regions)",
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
    the stream progress lines go to (``sys.stderr``; None: nowhere)."""

    cann: Optional[str] = None
    work: Optional[Path] = None
    eval_graph: bool = True
    memory: bool = False
    progress: Optional[TextIO] = None


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
            progress_line(
                setup.progress,
                f"compiling rank {rank} of {world}{' and running its step (level 1)' if memory else ''}: "
                f"{reduction.describe()} ...",
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
