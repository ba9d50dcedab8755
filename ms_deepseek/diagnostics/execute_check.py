"""``plan --recipe R --execute``: every rank's compiled program run on CPU and compared with one device.

A compile (``plan --compile``) proves that MindSpore accepts the recipe's layout; it does not prove that the
sharded step computes the numbers of the same step on one device. Here, for a reduced copy of the recipe:

1. **The reduction** (:func:`.execute_setup.reduce_recipe`): the recipe's own parallel settings (optimizer sharding,
   accumulation or pipeline micro-batches, recompute, sequence parallelism, vocabulary split, flash attention,
   LoRA targets, quantized base), each degree above 1 cut to 2 (a pipeline of 4 or more stages to 4: a first, two
   middle and a last stage; MindSpore compiles 1, 2, 4 or a multiple of 8 devices, ``device_manager.cc``
   CheckDeviceConfig), expert replicas kept when the recipe has them and the world stays within 8 ranks (dp = 2 x
   ep), the model cut in width
   and depth (:func:`.execute_setup.reduced_config`, one MoE layer per stage), float32 compute and master weights, no token
   dropped (``capacity_factor`` null: a dropped token depends on where each side's capacity falls, not on the
   math), LoRA dropout off (MindSpore draws other masks on another device count), the embedded corpus at a
   short sequence. It says which it used.
2. **The programs**: every rank compiled under MindSpore's dry run (:mod:`.compile_worker`, ``execute`` request)
   reading its slices of one random float32 checkpoint as a sharded run does before step 1; each hands back its
   compiled MindIR, its starting values and its parameters' compiled layouts.
3. **The batches**: each rank's inputs from the product's loader (``data.dataset.build_train_dataset`` with the
   rank's ``parallel_plan.ranks.data_coordinates``), and the global batch one device sees assembled from them:
   micro-batch ``i`` is every data slice's micro-batch ``i``, in slice order (MindSpore's view of a
   data-parallel input: ``_utils.py`` ``_to_full_tensor``).
4. **One device** (:mod:`.execute_reference`): the product's single-device run of the reduced recipe on those
   global batches, from the same checkpoint.
5. **The execution** (:mod:`.execute`): all ranks' programs on CPU for ``steps`` optimizer steps, the
   collectives done between them. Then, per step, the loss vector and gradient norm of every rank that computes
   them, and every parameter, optimizer state and counter each rank holds against the slice of the one-device
   value that the rank's compiled layout names (``mindspore.parallel._tensor`` ``_get_tensor_slice_index``:
   device matrix and tensor map, then the parallel optimizer's part ``np.split(slice, size)[index]``). The
   starting values are compared too: a rank that read the wrong slice fails before any step.

Tolerances are relative to the largest magnitude of the one-device tensor (float32; different reduction
orders differ in the last bits, and Adam's first steps turn a near-zero gradient's rounding into a full
``lr``-sized move, so the tolerance on updated tensors is stated separately from the loss's).
"""

from __future__ import annotations

import dataclasses
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
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from ms_deepseek.checkpoint.synthetic import write_random_checkpoint
from ms_deepseek.config.recipe import load_recipe, planning_config_path
from ms_deepseek.core.errors import UserError
from ms_deepseek.diagnostics import execute as ex
from ms_deepseek.diagnostics import execute_ranks as xr
from ms_deepseek.diagnostics.compile_check import compile_environment
from ms_deepseek.diagnostics.execute_setup import (
    ExecReduction,
    rank_batches,
    reduce_recipe,
    reduced_overrides,
    single_device_overrides,
    slice_for_rank,
)
from ms_deepseek.diagnostics.traffic import wire_factor
from ms_deepseek.parallel_plan.planner import check_recipe_fits

LOSS_TOLERANCE = 1e-5  # relative, on the loss vector, the gradient norm and the learning rate
VALUE_TOLERANCE = 1e-4  # relative to the whole tensor's largest magnitude, on optimizer states and counters
# Adam's update m / (sqrt(v) + eps) turns a gradient element near zero (|g| ~ eps) into a move of up to lr whose
# size depends on the last bits of g: a weight may differ by that much more (a fraction of the learning rates
# applied so far) without any difference in the math
ADAM_LR_FRACTION = 0.25
WORKER_TIMEOUT_S = 1800


# ----------------------------------------------------------------------------------------- running
@dataclass
class Difference:
    step: int
    rank: int
    name: str
    rel: float
    detail: str = ""


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
    largest: Optional[Difference] = None  # the largest difference found, within or not
    first_failure: Optional[Difference] = None
    compared: int = 0
    comm: Dict[str, Dict[str, float]] = field(default_factory=dict)  # "Kind ranks" -> {count, mb} per step
    operators: Dict[int, int] = field(default_factory=dict)
    seconds: Dict[str, float] = field(default_factory=dict)
    work: Optional[str] = None
    stage_size: int = 1  # ranks per pipeline stage of the reduced layout
    planner_gb: Dict[str, float] = field(default_factory=dict)  # the planner's traffic per NPU and step, same layout

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
            "compared": self.compared,
            "largest_difference": dataclasses.asdict(self.largest) if self.largest else None,
            "first_failure": dataclasses.asdict(self.first_failure) if self.first_failure else None,
            "communication_per_step": self.comm,
            "planner_communication_gb_per_npu": self.planner_gb,
            "operators_per_step": {str(k): v for k, v in self.operators.items()},
            "seconds": self.seconds,
            "work": self.work,
        }


def _export(recipe_path: str, overrides: List[str], world: int, cann, work: Path, jobs: int, say) -> None:
    """Every rank's program from a compile worker, ``jobs`` at a time; the first failure stops the others."""
    queue = list(range(world))
    running: Dict[int, Tuple[subprocess.Popen, object, float]] = {}
    failed: List[str] = []
    try:
        while (queue or running) and not failed:
            while queue and len(running) < jobs:
                rank = queue.pop(0)
                running[rank] = _start_worker(recipe_path, overrides, rank, world, cann, work)
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


def _start_worker(recipe_path: str, overrides: List[str], rank: int, world: int, cann, work: Path):
    folder = work / f"rank_{rank:05d}"
    folder.mkdir(parents=True, exist_ok=True)
    request = folder / "request.json"
    request.write_text(
        json.dumps({"recipe": str(Path(recipe_path).resolve()), "overrides": overrides, "execute": True})
    )
    env, _ = compile_environment(rank, world, cann, folder / "ir")
    for key in ("MS_DEV_SAVE_GRAPHS", "MS_DEV_DUMP_IR_PASSES", "MS_DEV_SAVE_GRAPHS_PATH"):  # no IR dump needed
        env.pop(key, None)
    log = open(folder / "worker.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "ms_deepseek.diagnostics.compile_worker", str(request)],
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


def _start_reference(recipe_path: str, overrides: List[str], batches, steps: int, work: Path) -> subprocess.Popen:
    """The one-device run in its own CPU process (:mod:`.execute_reference`), started beside the compile workers."""
    folder = work / "one_device"
    folder.mkdir(parents=True, exist_ok=True)
    arrays = {}
    for s, (ids, labels) in enumerate(batches, start=1):
        arrays[f"ids_{s}"], arrays[f"labels_{s}"] = ids, labels
    np.savez(folder / "batches.npz", **arrays)
    request = folder / "request.json"
    request.write_text(json.dumps({"recipe": str(Path(recipe_path).resolve()), "overrides": overrides, "steps": steps}))
    env = dict(os.environ)
    for key in ("MS_SIMULATION_LEVEL", "RANK_SIZE", "RANK_ID", "MS_WORKER_NUM", "MS_ROLE", "MS_DEEPSEEK_DEVICE"):
        env.pop(key, None)
    env["MS_DEEPSEEK_DEVICE"] = "CPU"
    env.setdefault("GLOG_v", "3")
    with open(folder / "reference.log", "wb") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "ms_deepseek.diagnostics.execute_reference", str(request)],
            cwd=folder,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )


def _finish_reference(proc: subprocess.Popen, work: Path) -> Dict:
    folder = work / "one_device"
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
    return json.loads((folder / "result.json").read_text())


def _rel(a: np.ndarray, b: np.ndarray, scale: Optional[float] = None) -> float:
    """max |a - b| over the largest magnitude of ``b`` (or ``scale``: the whole tensor's, for a slice)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape:
        return math.inf
    if a.size == 0:
        return 0.0
    if scale is None:
        scale = float(np.max(np.abs(b))) if b.size else 0.0
    return float(np.max(np.abs(a - b))) / max(scale, 1e-30)


def execute_recipe(
    recipe_path: str,
    recipe,
    user_overrides: List[str],
    steps: int = 2,
    cann: Optional[str] = None,
    work: Optional[Path] = None,
    progress: Optional[Callable[[str], None]] = None,
    jobs: int = 2,
) -> ExecReport:
    """Run the recipe's reduced layout rank by rank and compare it with one device (module docstring); ``jobs``
    compile workers at a time."""

    say = progress or (lambda msg: None)
    red = reduce_recipe(recipe)
    own = work is None
    work = Path(tempfile.mkdtemp(prefix="ms-deepseek-execute-")) if own else Path(work)
    work.mkdir(parents=True, exist_ok=True)
    report = ExecReport(recipe_path, recipe.parallel.describe(), red, steps, work=str(work))
    report.stage_size = red.layout["dp"] * red.layout["tp"]
    clock = time.time()
    base = dataclasses.replace(recipe.model_config, **red.config)
    weights = write_random_checkpoint(work / "weights", base, dtype="float32", seed=recipe.train.seed)
    overrides = list(user_overrides) + reduced_overrides(red, weights, recipe)
    reduced = load_recipe(recipe_path, overrides, planning_config_path(recipe_path))
    if reduced.parallel.world_size != red.world:
        raise UserError(f"--execute: the reduced layout has {reduced.parallel.world_size} ranks, expected {red.world}")
    per_rank, global_batches = rank_batches(reduced, steps)

    report.planner_gb = dict(check_recipe_fits(reduced).comm_gb)
    report.seconds["setup"] = round(time.time() - clock, 1)
    clock = time.time()
    say(f"training the same {steps} steps on one device, beside the compiles ...")
    one_device = _start_reference(
        recipe_path, overrides + single_device_overrides(reduced), global_batches, steps, work
    )
    try:
        _export(recipe_path, overrides, red.world, cann, work / "ranks", jobs, say)
        one = _finish_reference(one_device, work)
    finally:
        if one_device.poll() is None:
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


def _execute_and_compare(report: ExecReport, recipe, work: Path, per_rank, one: Dict, steps: int) -> None:
    import mindspore as ms
    from mindspore import Parameter, Tensor
    from safetensors.numpy import load_file

    ms.set_context(mode=ms.PYNATIVE_MODE)
    par = recipe.parallel
    world = par.world_size
    stage_size = par.dp * par.tp
    programs, envs, metas = [], [], []
    for rank in range(world):
        folder = work / "ranks" / f"rank_{rank:05d}"
        program = ex.RankProgram.from_bytes(rank, (folder / "program.mindir").read_bytes())
        values = load_file(str(folder / "values.safetensors"))
        meta = json.loads((folder / "program.json").read_text())
        env = {g: Parameter(Tensor(values[name]), name=name) for g, name in program.parameters.items()}
        programs.append(program)
        envs.append(env)
        metas.append(meta)
    last_stage = [r for r in range(world) if r // stage_size == par.pp - 1]
    ref0 = load_file(str(work / "one_device" / "values_0.safetensors"))
    _compare_values(report, 0, programs, envs, metas, ref0, stage_size)
    kernels = ex.Kernels()
    lr_applied = 0.0
    for step in range(1, steps + 1):
        if report.first_failure is not None:
            break
        for rank, (program, env) in enumerate(zip(programs, envs)):
            ids, labels = per_rank[rank][step - 1]
            env[program.inputs[0]], env[program.inputs[1]] = Tensor(ids), Tensor(labels)
        stats: Dict[int, xr.RankStats] = {}
        try:
            outputs = xr.run_ranks(programs, [dict(e) for e in envs], world, kernels, stats)
        except ex.ExecutionError as exc:
            report.error = str(exc)
            return
        if step == 1:
            _communication(report, stats)
        expected = one["steps"][step - 1]
        lr_applied += expected["lr"]
        for rank in last_stage:
            vec, norm = outputs[rank][0].asnumpy(), float(outputs[rank][1].asnumpy())
            want = np.asarray(expected["outputs"])
            where = _loss_part(int(np.argmax(np.abs(vec - want))), recipe.model_config.n_routed_experts or 0)
            _note(report, Difference(step, rank, "loss vector", _rel(vec, want), where), LOSS_TOLERANCE)
            _note(report, Difference(step, rank, "gradient norm", _rel(norm, expected["grad_norm"])), LOSS_TOLERANCE)
        for rank in range(world):
            lr = float(outputs[rank][2].asnumpy())
            _note(report, Difference(step, rank, "learning rate", _rel(lr, expected["lr"])), LOSS_TOLERANCE)
        first = outputs[last_stage[0]]
        report.losses.append([expected["outputs"][1], float(first[0].asnumpy()[1])])
        report.grad_norms.append([expected["grad_norm"], float(first[1].asnumpy())])
        ref = load_file(str(work / "one_device" / f"values_{step}.safetensors"))
        _compare_values(report, step, programs, envs, metas, ref, stage_size, lr_applied)
    report.ok = not report.error and report.first_failure is None and report.compared > 0


def _compare_values(report, step, programs, envs, metas, ref, stage_size, lr_applied: float = 0.0) -> None:
    """Every tensor a rank holds against its slice of the one-device value: starting values within
    ``LOSS_TOLERANCE``, optimizer states and counters within ``VALUE_TOLERANCE`` of the whole tensor's largest
    magnitude, trained weights within that plus ``ADAM_LR_FRACTION`` of the learning rates applied so far."""
    for program, env, meta in zip(programs, envs, metas):
        for graph_name, name in program.parameters.items():
            if name not in ref or name.endswith(".expert_placement"):
                # MindSpore's own buffers (accu_grads, the accumulation's) have no one-device value; the expert
                # placement table is the layout's (identity on one device): a wrong one shows in the loss
                continue
            entry = meta["parameters"].get(name, {"layout": [[], [], [], 0, True, "", []], "part": None})
            full = ref[name]
            expected = slice_for_rank(full, entry, program.rank, stage_size)
            got = env[graph_name].asnumpy()
            scale = float(np.max(np.abs(full))) if full.size else 0.0
            report.compared += 1
            tolerance = VALUE_TOLERANCE
            if step == 0:
                tolerance = LOSS_TOLERANCE
            elif f"adam_m.{name}" in ref:  # a trained weight
                tolerance += ADAM_LR_FRACTION * lr_applied / max(scale, 1e-30)
            detail = _layout_text(entry)
            if got.shape != expected.shape:
                detail += f"; shape {list(got.shape)} against {list(expected.shape)}"
            rel = _rel(got, expected, scale)
            if os.environ.get("MS_DEEPSEEK_EXECUTE_TRACE"):
                print(f"step {step} rank {program.rank} {name} {rel:.2e} {tolerance:.1e}", file=sys.stderr)
            _note(report, Difference(step, program.rank, name, rel, detail), tolerance)


def _loss_part(index: int, experts: int) -> str:
    """What entry ``index`` of the step's output vector is (``train.step.StepOutputs``: total, loss, balance loss,
    then per MoE layer its expert loads, dropped fraction and three balance-loss terms)."""
    if index < 3:
        return ("total loss", "LM loss", "balance loss")[index]
    layer, field = divmod(index - 3, experts + 4)
    what = (
        f"expert {field} load" if field < experts else ("dropped fraction", "l_exp", "l_dev", "l_com")[field - experts]
    )
    return f"MoE layer {layer} (of the model's MoE layers): {what}; a routing difference"


def _layout_text(entry: Dict) -> str:
    """How the rank holds the tensor, as MindSpore compiled it: device matrix, tensor map, optimizer part."""
    dev, tmap = entry["layout"][0], entry["layout"][1]
    text = f"compiled layout: device matrix {list(dev)}, tensor map {list(tmap)}" if tmap else "replicated"
    if entry.get("part"):
        text += f", optimizer-shard part {entry['part'][0]} of {entry['part'][1]}"
    return text


def _note(report: ExecReport, diff: Difference, tolerance: float) -> None:
    if report.largest is None or diff.rel > report.largest.rel:
        report.largest = diff
    if diff.rel > tolerance and report.first_failure is None:
        report.first_failure = diff


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
    if report.largest is not None:
        d = report.largest
        lines.append(
            f"  largest difference: {d.rel:.2e} (step {d.step}, rank {d.rank}, {d.name}); {report.compared} tensors compared"
        )
    timing = ", ".join(f"{k} {v:.0f} s" for k, v in report.seconds.items())
    lines.append(f"  time: {timing}")
    if report.error:
        lines.append(f"FAILED: {report.error}")
    elif report.first_failure is not None:
        d = report.first_failure
        lines.append(
            f"DIFFERS: step {d.step}, rank {d.rank} (stage {d.rank // report.stage_size}): {d.name} differs from one "
            f"device by {d.rel:.2e} of its largest magnitude{' (' + d.detail + ')' if d.detail else ''}"
        )
    else:
        lines.append(
            f"agrees with one device within {LOSS_TOLERANCE:g} (loss, gradient norm) and {VALUE_TOLERANCE:g} (values)"
        )
    if report.work:
        lines.append(f"  kept: {report.work}")
    return "\n".join(lines)
