"""``plan --recipe R --execute``: every rank's compiled program run on CPU and compared with one device.

A compile (``plan --compile``) proves that MindSpore accepts the recipe's layout; it does not prove that the
sharded step computes the numbers of the same step on one device. Here, for a reduced copy of the recipe:

1. **The reduction** (:func:`.setup.reduce_recipe`): the recipe's own parallel settings (optimizer sharding,
   accumulation or pipeline micro-batches, recompute, sequence parallelism, vocabulary split, flash attention,
   LoRA targets, quantized base), each degree above 1 cut to 2 (a pipeline of 4 or more stages to 4: a first, two
   middle and a last stage; MindSpore compiles 1, 2, 4 or a multiple of 8 devices, ``device_manager.cc``
   CheckDeviceConfig), expert replicas kept when the recipe has them and the world stays within 8 ranks (dp = 2 x
   ep), the model cut in width
   and depth (:func:`.setup.reduced_config`, one MoE layer per stage), float32 compute and master weights, no token
   dropped (``capacity_factor`` null: a dropped token depends on where each side's capacity falls, not on the
   math), LoRA dropout off (MindSpore draws other masks on another device count), the embedded corpus at a
   short sequence. It says which it used.
2. **The programs**: every rank compiled under MindSpore's dry run (:mod:`~ms_deepseek.verification.compile.worker`, ``execute`` request)
   reading its slices of one random float32 checkpoint as a sharded run does before step 1; each hands back its
   compiled MindIR, its starting values and its parameters' compiled layouts.
3. **The batches**: each rank's inputs from the product's loader (``data.dataset.build_train_dataset`` with the
   rank's ``parallel_plan.ranks.data_coordinates``), and the global batch one device reads from the same loader
   at world size 1 (:func:`.setup.one_device_batches`). The rows the ranks hold, each where MindSpore
   places it (``_utils.py`` ``_to_full_tensor``), must be exactly the one-device micro-batches' rows
   (:func:`.setup.check_rows`): a loader that hands two replicas the same rows, or drops one, is refused
   before anything runs.
4. **One device** (:mod:`.one_device`): the product's single-device run of the reduced recipe on its own
   global batches, from the same checkpoint.
5. **The execution** (:mod:`.executor`): all ranks' programs on CPU for ``steps`` optimizer steps, the
   collectives done between them. Then, per step, the loss vector and gradient norm of every rank that computes
   them, and every tensor each rank holds against the slice of the one-device value that the rank's compiled
   layout names (``mindspore.parallel._tensor`` ``_get_tensor_slice_index``: device matrix and tensor map, then
   the parallel optimizer's part ``np.split(slice, size)[index]``): the starting values, each trained weight's
   change per step, every other tensor's value; every tensor covered and counted (:mod:`.compare`, which
   also states the tolerances).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, TextIO, Tuple

import numpy as np

from ms_deepseek.checkpoint.convert.synthetic import write_random_checkpoint
from ms_deepseek.core.errors import UserError
from ms_deepseek.core.progress import progress_line
from ms_deepseek.parallel_plan.planner import check_recipe_fits
from ms_deepseek.verification.compile.traffic import wire_factor
from ms_deepseek.verification.dryrun import compile_environment
from ms_deepseek.verification.execute import cache as execute_cache
from ms_deepseek.verification.execute import compare as cmp
from ms_deepseek.verification.execute import executor as ex
from ms_deepseek.verification.execute import scheduler as xr
from ms_deepseek.verification.execute.setup import (
    SEQ_LEN,
    ExecReduction,
    check_rows,
    one_device_batches,
    rank_batches,
    reduce_recipe,
    reduced_overrides,
    single_device_overrides,
)

WORKER_TIMEOUT_S = 1800


# ----------------------------------------------------------------------------------------- running
@dataclass
class ExecReport:
    recipe: str
    layout: str
    reduction: ExecReduction
    steps: int
    ok: bool = False
    error: str = ""
    losses: List[List[float]] = field(default_factory=list)  # per step: one device, then sharded
    grad_norms: List[List[float]] = field(default_factory=list)
    verdict: Optional[cmp.Comparison] = None
    comm: Dict[str, Dict[str, float]] = field(default_factory=dict)  # "Kind ranks" -> {count, mb} per step
    operators: Dict[int, int] = field(default_factory=dict)
    seconds: Dict[str, float] = field(default_factory=dict)
    work: Optional[str] = None
    stage_size: int = 1  # ranks per pipeline stage of the reduced layout
    planner_gb: Dict[str, float] = field(default_factory=dict)  # the planner's traffic per NPU and step, same layout

    @property
    def first_failure(self) -> Optional[cmp.Difference]:
        return self.verdict.first_failure if self.verdict else None

    def _verdict_dict(self) -> Dict:
        v = self.verdict

        def diff(d: Optional[cmp.Difference]) -> Optional[Dict]:
            # JSON has no infinity: a difference that is not a number (a NaN, a shape, a missing tensor) is null
            return dict(dataclasses.asdict(d), rel=d.rel if math.isfinite(d.rel) else None) if d else None

        return {
            "compared": v.compared if v else 0,
            "updates_compared": v.updates if v else 0,
            "reassembled": v.reassembled if v else 0,
            "unused": sorted(v.unused) if v else [],
            "mindspore_buffers": dict(v.buffers) if v else {},
            "adam_allowance_elements": v.adam_allowance if v else 0,
            "rounding_allowance_elements": v.rounding_allowance if v else 0,
            "largest_difference": diff(v.largest) if v else None,
            "largest_update_difference": diff(v.largest_update) if v else None,
            "first_failure": diff(v.first_failure) if v else None,
            "failures": len(v.failures) if v else 0,
        }

    def to_dict(self) -> Dict:
        return {
            "recipe": self.recipe,
            "layout": self.layout,
            "reduction": self.reduction.describe(),
            "notes": self.reduction.notes,
            "world_size": self.reduction.world,
            "steps": self.steps,
            "agrees": self.ok,
            "error": self.error,
            "loss": self.losses,
            "grad_norm": self.grad_norms,
            **self._verdict_dict(),
            "communication_per_step": self.comm,
            "planner_communication_gb_per_npu": self.planner_gb,
            "operators_per_step": {str(k): v for k, v in self.operators.items()},
            "seconds": self.seconds,
            "work": self.work,
        }


def _export(recipe: Dict, world: int, cann, work: Path, jobs: int, say) -> None:
    """Every rank's program from a compile worker given ``recipe`` (``Recipe.to_request``), ``jobs`` at a time; the
    first failure stops the others."""
    queue = list(range(world))
    running: Dict[int, Tuple[subprocess.Popen, object, float]] = {}
    failed: List[str] = []
    try:
        while (queue or running) and not failed:
            while queue and len(running) < jobs:
                rank = queue.pop(0)
                running[rank] = _start_worker(recipe, rank, world, cann, work)
                say(f"compiling rank {rank} of {world} ...")
            for rank, (proc, log, started) in list(running.items()):
                if proc.poll() is None and time.time() - started < WORKER_TIMEOUT_S:
                    continue
                if proc.poll() is None:
                    proc.kill()
                    failed.append(f"rank {rank}: the compile gave no answer in {WORKER_TIMEOUT_S} s (stopped)")
                log.close()
                del running[rank]
                failed += _worker_failure(work / f"rank_{rank:05d}", rank)
            time.sleep(0.2)
    finally:
        for proc, log, _ in running.values():
            proc.kill()
            log.close()
    if failed:
        raise UserError(failed[0])


def _start_worker(recipe: Dict, rank: int, world: int, cann, work: Path):
    folder = work / f"rank_{rank:05d}"
    folder.mkdir(parents=True, exist_ok=True)
    request = folder / "request.json"
    request.write_text(json.dumps({"recipe": recipe, "execute": True}))
    env, _ = compile_environment(rank, world, cann, folder / "ir")
    for key in ("MS_DEV_SAVE_GRAPHS", "MS_DEV_DUMP_IR_PASSES", "MS_DEV_SAVE_GRAPHS_PATH"):  # no IR dump needed
        env.pop(key, None)
    log = open(folder / "worker.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "ms_deepseek.verification.compile.worker", str(request)],
        cwd=folder,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    return proc, log, time.time()


def _worker_failure(folder: Path, rank: int) -> List[str]:
    result = folder / "result.json"
    if not result.is_file():
        tail = (folder / "worker.log").read_text(errors="replace").strip().splitlines()[-3:]
        return [f"rank {rank}: the compile worker died: {' | '.join(tail)} (log: {folder / 'worker.log'})"]
    graphs = json.loads(result.read_text()).get("graphs", {})
    for name, g in graphs.items():
        if not g.get("ok"):
            where = f" at {g['where']}" if g.get("where") else ""
            return [f"rank {rank} {name}: {g.get('error', '')}{where} (log: {folder / 'worker.log'})"]
    return []


def _start_reference(recipe, batches, steps: int, work: Path, ep: int):
    """The one-device run of ``recipe`` in its own CPU process (:mod:`.one_device`), started beside the
    compile workers; its balance losses over the ``ep`` device groups of the layout it is compared with. Returns
    the process (None when :mod:`.cache` held the same run and restored it) and the run's cache key (None
    without a cache folder)."""
    folder = work / "one_device"
    folder.mkdir(parents=True, exist_ok=True)
    arrays = {}
    for s, (ids, labels) in enumerate(batches, start=1):
        arrays[f"ids_{s}"], arrays[f"labels_{s}"] = ids, labels
    np.savez(folder / "batches.npz", **arrays)
    request = {
        "recipe": recipe.to_request(),
        "steps": steps,
        "expert_parallel": ep,
    }
    (folder / "request.json").write_text(json.dumps(request))
    env = dict(os.environ)
    for key in ("MS_SIMULATION_LEVEL", "RANK_SIZE", "RANK_ID", "MS_WORKER_NUM", "MS_ROLE", "MS_DEEPSEEK_DEVICE"):
        env.pop(key, None)
    env["MS_DEEPSEEK_DEVICE"] = "CPU"
    # the reference operators, MindSpore's own (ops.reference): a float32 softmax compiled for Ascend is MindSpore's
    # Softmax (ops/api.py FP32Softmax), which the executor runs on MindSpore's CPU kernel; our C++ kernel on one
    # device would differ from it by the two kernels' rounding of exp, not by the layout
    env["MS_DEEPSEEK_OPS"] = "reference"
    env.setdefault("GLOG_v", "3")
    # the key reads the recipe, the named files and the package: only worth it with a cache folder to look in
    cache_key = execute_cache.key(recipe, arrays, request, env) if execute_cache.folder() else None
    if cache_key and execute_cache.restore(cache_key, folder):
        return None, cache_key
    with open(folder / "reference.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ms_deepseek.verification.execute.one_device", str(folder / "request.json")],
            cwd=folder,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    return proc, cache_key


def _finish_reference(proc: Optional[subprocess.Popen], work: Path, cache_key: Optional[str]) -> Dict:
    folder = work / "one_device"
    if proc is None:  # restored from the cache
        return json.loads((folder / "result.json").read_text())
    try:
        code = proc.wait(timeout=WORKER_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise UserError(
            f"the one-device run gave no answer in {WORKER_TIMEOUT_S} s (log: {folder / 'reference.log'})"
        ) from None
    if code != 0 or not (folder / "result.json").is_file():
        tail = (folder / "reference.log").read_text(errors="replace").strip().splitlines()[-3:]
        raise UserError(f"the one-device run failed: {' | '.join(tail)} (log: {folder / 'reference.log'})")
    if cache_key:
        execute_cache.store(cache_key, folder)
    return json.loads((folder / "result.json").read_text())


def execute_recipe(
    recipe,
    steps: int = 2,
    cann: Optional[str] = None,
    work: Optional[Path] = None,
    progress: Optional[TextIO] = None,
    jobs: int = 2,
) -> ExecReport:
    """Run the reduced layout of ``recipe`` (loaded with its overrides; its ``parallel`` section may hold layout
    flags applied after loading) rank by rank and compare it with one device (module docstring); ``jobs`` compile
    workers at a time; progress lines go to the stream ``progress`` (None: nowhere)."""

    def say(message: str) -> None:
        progress_line(progress, message)

    red = reduce_recipe(recipe)
    own = work is None
    work = Path(tempfile.mkdtemp(prefix="ms-deepseek-execute-")) if own else Path(work)
    work.mkdir(parents=True, exist_ok=True)
    report = ExecReport(recipe.source_path, recipe.parallel.describe(), red, steps, work=str(work))
    report.stage_size = red.layout["dp"] * red.layout["tp"]
    clock = time.time()
    base = dataclasses.replace(recipe.model_config, **red.config)
    weights = write_random_checkpoint(work / "weights", base, dtype="float32", seed=recipe.train.seed)
    reduced = recipe.with_overrides(reduced_overrides(red, weights, recipe, _sft_folder(red)))
    if reduced.parallel.world_size != red.world:
        raise UserError(f"--execute: the reduced layout has {reduced.parallel.world_size} ranks, expected {red.world}")
    per_rank = rank_batches(reduced, steps)
    global_batches = one_device_batches(reduced, steps)
    report.verdict = cmp.Comparison(report.stage_size, cmp.Adam(reduced.optim.beta1, reduced.optim.eps))
    for step, rank, problem in check_rows(reduced, per_rank, global_batches):
        report.verdict.note(cmp.Difference(step, rank, "batch rows", math.inf, problem), 0.0)
    if report.first_failure is not None:  # the data is wrong: nothing to run
        report.seconds["setup"] = round(time.time() - clock, 1)
        return report

    report.planner_gb = dict(check_recipe_fits(reduced).comm_gb)
    report.seconds["setup"] = round(time.time() - clock, 1)
    clock = time.time()
    say(f"training the same {steps} steps on one device, beside the compiles ...")
    one_device, cache_key = _start_reference(
        reduced.with_overrides(single_device_overrides(reduced)), global_batches, steps, work, red.layout["ep"]
    )
    if one_device is None:
        red.notes.append(f"one device: the same run restored from {execute_cache.ENV} ({cache_key})")
    try:
        _export(reduced.to_request(), red.world, cann, work / "ranks", jobs, say)
        one = _finish_reference(one_device, work, cache_key)
    finally:
        if one_device is not None and one_device.poll() is None:
            one_device.kill()
    report.seconds["compile_and_one_device"] = round(time.time() - clock, 1)
    clock = time.time()
    say(f"executing the {red.world} ranks' programs on CPU ...")
    _execute_and_compare(report, reduced, work, per_rank, one, steps)
    report.seconds["execute"] = round(time.time() - clock, 1)
    if own and report.ok:
        shutil.rmtree(work, ignore_errors=True)
        report.work = None
    return report


def _sft_folder(red: ExecReduction) -> Optional[Path]:
    """The embedded chat corpus at the reduction's sequence length and vocabulary (an SFT recipe's data)."""
    if not red.sft:
        return None
    from ms_deepseek.config.data import DataConfig
    from ms_deepseek.data.sources import ensure_embedded_chat

    return ensure_embedded_chat(DataConfig(seq_len=SEQ_LEN, embedded_vocab_size=int(red.config["vocab_size"])))


def _execute_and_compare(report: ExecReport, recipe, work: Path, per_rank, one: Dict, steps: int) -> None:
    import mindspore as ms
    from mindspore import Parameter, Tensor
    from safetensors.numpy import load_file

    ms.set_context(mode=ms.PYNATIVE_MODE)
    par = recipe.parallel
    world = par.world_size
    stage_size = par.dp * par.tp
    programs, envs, held = [], [], []
    for rank in range(world):
        folder = work / "ranks" / f"rank_{rank:05d}"
        program = ex.RankProgram.from_bytes(rank, (folder / "program.mindir").read_bytes())
        values = load_file(str(folder / "values.safetensors"))
        layouts = json.loads((folder / "program.json").read_text())["parameters"]
        envs.append({g: Parameter(Tensor(values[name]), name=name) for g, name in program.parameters.items()})
        programs.append(program)
        held.append(cmp.RankValues(rank, _values(program, envs[-1]), {}, layouts))
    verdict = report.verdict
    last_stage = [r for r in range(world) if r // stage_size == par.pp - 1]
    before = load_file(str(work / "one_device" / "values_0.safetensors"))
    verdict.tensors(0, held, before)
    kernels = ex.Kernels()
    describe = functools.partial(cmp.loss_part, experts=recipe.model_config.n_routed_experts or 0)
    for step in range(1, steps + 1):
        if verdict.first_failure is not None:
            break
        for rank, (program, env) in enumerate(zip(programs, envs)):
            ids, labels = per_rank[rank][step - 1]
            env[program.inputs[0]], env[program.inputs[1]] = Tensor(ids), Tensor(labels)
        stats: Dict[int, xr.RankStats] = {}
        try:
            outputs = xr.run_ranks(programs, [dict(e) for e in envs], world, kernels, stats)
        except ex.ExecutionError as exc:
            report.error = f"step {step}: {exc}"
            return
        if step == 1:
            _communication(report, stats)
        expected = one["steps"][step - 1]
        for rank in last_stage:
            vec, norm = outputs[rank][0].asnumpy(), outputs[rank][1].asnumpy()
            want = np.asarray(expected["outputs"])
            if os.environ.get("MS_DEEPSEEK_EXECUTE_TRACE"):
                print(f"step {step} rank {rank} loss vector {vec.tolist()} one device {want.tolist()}", file=sys.stderr)
            verdict.scalars(step, rank, "loss vector", vec, want, describe)
            verdict.scalars(step, rank, "gradient norm", norm, expected["grad_norm"])
        for rank in range(world):
            verdict.scalars(step, rank, "learning rate", outputs[rank][2].asnumpy(), expected["lr"])
        first = outputs[last_stage[0]]
        report.losses.append([expected["outputs"][1], float(first[0].asnumpy()[1])])
        report.grad_norms.append([expected["grad_norm"], float(first[1].asnumpy())])
        now = load_file(str(work / "one_device" / f"values_{step}.safetensors"))
        for values, program, env in zip(held, programs, envs):
            values.before, values.now = values.now, _values(program, env)
        verdict.tensors(step, held, now, before)
        before = now
    report.ok = not report.error and verdict.first_failure is None and verdict.compared > 0


def _values(program, env) -> Dict[str, np.ndarray]:
    """A rank's tensors by their own names, as numpy copies (the next step updates the Parameters in place)."""
    return {name: env[graph_name].asnumpy().copy() for graph_name, name in program.parameters.items()}


def _communication(report: ExecReport, stats) -> None:
    """Per kind and group: collectives and MiB per step, summed over the group's members' inputs, and the MiB each
    member sends on a ring for them (``traffic.wire_factor``, the planner's counting)."""

    for rank_stats in stats.values():
        for (kind, group), c in rank_stats.comm.items():
            key = f"{kind} [{','.join(map(str, group))}]"
            entry = report.comm.setdefault(key, {"count": 0, "mb": 0.0, "wire_mb": 0.0})
            entry["count"] += c.count
            entry["mb"] = round(entry["mb"] + c.bytes / 2**20, 4)
            # a point-to-point Send moves all its bytes (its Receive none); collectives by the ring's factor
            factor = {"Send": 1.0, "Receive": 0.0}.get(kind, wire_factor(kind, len(group)))
            entry["wire_mb"] = round(entry["wire_mb"] + c.bytes * factor / 2**20, 4)
        report.operators = {r: s.operators for r, s in stats.items()}


def _where(report: ExecReport, d: cmp.Difference) -> str:
    return "all ranks" if d.rank < 0 else f"rank {d.rank} (stage {d.rank // report.stage_size})"


def format_report(report: ExecReport) -> str:
    lines = [
        f"execute {report.recipe}: {report.layout}; reduced to {report.reduction.describe()}",
        "  " + "; ".join(report.reduction.notes),
    ]
    for i, (loss, norm) in enumerate(zip(report.losses, report.grad_norms), start=1):
        lines.append(
            f"  step {i}: loss one device {loss[0]:.7f}, sharded {loss[1]:.7f}; "
            f"gradient norm {norm[0]:.7g} / {norm[1]:.7g}"
        )
    if report.comm:
        lines.append("  communication per step (all ranks' inputs, per group):")
        for key, c in sorted(report.comm.items()):
            lines.append(
                f"    {key}: {c['count']} operators, {c['mb']:.3f} MiB in, {c['wire_mb']:.3f} MiB sent on a ring"
            )
    if report.planner_gb:
        lines.append(
            "  the planner for the same reduced layout, per NPU and step: "
            + ", ".join(f"{k} {v * 1024:.3f} MiB" for k, v in sorted(report.planner_gb.items()))
        )
    if report.operators:
        lines.append(f"  operators per step: {sum(report.operators.values())} over {len(report.operators)} ranks")
    verdict = report.verdict
    if verdict is not None and verdict.largest is not None:
        d = verdict.largest
        lines.append(f"  largest difference: {d.rel:.2e} of its scale (step {d.step}, {_where(report, d)}, {d.name})")
        if verdict.largest_update is not None:
            u = verdict.largest_update
            lines.append(
                f"  largest difference of a step's change: {u.rel:.2e} of the largest one-device change (step "
                f"{u.step}, {_where(report, u)}, {u.name})"
            )
    if verdict is not None:
        lines += [f"  {line}" for line in cmp.summary(verdict)]
    timing = ", ".join(f"{k} {v:.0f} s" for k, v in report.seconds.items())
    lines.append(f"  time: {timing}")
    if report.error:
        lines.append(f"FAILED: {report.error}")
    elif report.first_failure is not None:
        d = report.first_failure
        lines.append(
            f"DIFFERS: step {d.step}, {_where(report, d)}: {d.name} differs from one device by {d.rel:.2e} of its "
            f"scale{' (' + d.detail + ')' if d.detail else ''}; {len(report.verdict.failures)} differences beyond "
            "their tolerance in all"
        )
    else:
        lines.append(
            f"agrees with one device within {cmp.LOSS_TOLERANCE:g} (each loss entry and the gradient norm of the "
            f"first step, {cmp.LATER_LOSS_TOLERANCE:g} after it; the learning rate; starting values), "
            f"{cmp.UPDATE_TOLERANCE:g} (each step's change of a trained weight) and {cmp.VALUE_TOLERANCE:g} (others)"
        )
    if report.work:
        lines.append(f"  kept: {report.work}")
    return "\n".join(lines)
