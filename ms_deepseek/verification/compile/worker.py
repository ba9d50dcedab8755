"""One simulated rank of the compile check: MindSpore's dry run compiles the recipe's graphs.

Run by :mod:`ms_deepseek.verification.compile.check` as
``python -m ms_deepseek.verification.compile.worker REQUEST.json`` in a process whose environment
holds MindSpore's dry run (``MS_SIMULATION_LEVEL=0``, ``RANK_SIZE`` / ``RANK_ID`` of the simulated
world, ``MS_DEEPSEEK_DEVICE=Ascend``) and CANN's libraries or their stubs
(:mod:`ms_deepseek.verification.cann_stubs`). The request holds the recipe as the caller loaded it
(``Recipe.to_request``: its mapping, overrides and architecture), so the worker reads no recipe or config file.

It builds the run from the trainer's own parts (:mod:`ms_deepseek.train.build`: the planner's verdict,
collective group, model, plan, optimizer, step, ``AutoParallel`` wrapper) with two differences,
both about what is on the machine, not about the graph: no data (the batches are zeros of the
shape a rank reads, ``[k * rows, seq_len]`` for the step, ``[rows, seq_len]`` for validation) and
no weights (the model is built unallocated, ``no_init_parameters``, also for LoRA and QLoRA bases;
nothing is read or initialised, since a compile needs shapes only). Then it compiles the training
step and the validation graph, checks the compiled parameter layouts against the plan
(:mod:`ms_deepseek.parallel_apply.compiled_check`) and writes ``result.json`` beside the request. At
``MS_SIMULATION_LEVEL=0`` it never runs a step: under the dry run a compiled step returns placeholders.
With ``"memory": true`` in the request (``plan --compile --memory``, ``MS_SIMULATION_LEVEL=1``) it calls the
compiled step once, which MindSpore runs without kernels while accounting every device allocation (its
peak is 0 if the step is only compiled: docs/planner.md, "Against MindSpore's memory accounting"), and skips the validation graph; nothing is
saved and the process ends after that step.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
import traceback
from pathlib import Path
from typing import Dict

import numpy as np

from ms_deepseek.core.atomic import atomic_write_text
from ms_deepseek.core.errors import UserError
from ms_deepseek.train.context import ModelSource, RunContext

_PACKAGE = str(Path(__file__).resolve().parents[1])


def peak_rss_mb() -> float:
    """This process's peak resident memory (Linux ``ru_maxrss`` is in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def describe_failure(exc: BaseException) -> Dict[str, str]:
    """MindSpore's first error line and the first line of our source in the traceback."""
    text = str(exc).strip()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    # MindSpore's C++ errors come as a block: the message first, then "----" sections with the C++ stack
    first = next((ln for ln in lines if not ln.startswith("-")), type(exc).__name__)
    ours = ""
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        if frame.filename.startswith(_PACKAGE):
            ours = f"{os.path.relpath(frame.filename, os.path.dirname(_PACKAGE))}:{frame.lineno} ({frame.name})"
            break
    # MindSpore names the user's source line of the failing node in its message ("In file ...py:NN")
    for ln in lines:
        if "In file" in ln and _PACKAGE in ln:
            ours = ln.split("In file", 1)[1].strip().replace(os.path.dirname(_PACKAGE) + os.sep, "")
            break
    return {"error": first[:2000], "where": ours, "kind": type(exc).__name__}


def _install_op_info(work: Path) -> None:
    """Our Ascend C ops in the graph as they would be with the kernels installed: their ops-info file, from
    the OpDef sources (``ops.opdef``), where MindSpore looks for the running SoC, unless a CANN host
    already has the ops installed; and ``MS_DEEPSEEK_OPS=kernel``, so a missing op fails instead of
    falling back to the reference (which would compile another graph than the cluster's)."""
    from ms_deepseek.ops import ascend, opdef

    os.environ["MS_DEEPSEEK_OPS"] = "kernel"
    soc = ascend.soc_version()
    if set(ascend.OP_TYPES.values()) <= ascend.installed_op_types(soc):
        return
    vendor = opdef.write_vendor(work / "opp_vendor" / ascend.VENDOR, soc)
    paths = [str(vendor)] + [p for p in os.environ.get("ASCEND_CUSTOM_OPP_PATH", "").split(":") if p]
    os.environ["ASCEND_CUSTOM_OPP_PATH"] = ":".join(paths)


class CompileRun:
    """The trainer's set-up (:mod:`ms_deepseek.train.build`) without data, weights or steps; its methods
    compile its graphs."""

    def __init__(self, recipe, out: Path):
        from ms_deepseek.core.runtime import use_device
        from ms_deepseek.jobs.distributed import init_distributed
        from ms_deepseek.train.build import build_model, build_step, fit_plan
        from ms_deepseek.train.lora_run import model_converter
        from ms_deepseek.train.parallelism import parallelism_of

        par = recipe.parallel
        plan = fit_plan(recipe, force=True)  # as the trainer, minus what is about the machine: reported, not enforced
        use_device()
        rank, world = init_distributed(par)
        self.ctx = RunContext(recipe, out, rank, world)
        self.sharded = par.uses_semi_auto
        strategy = parallelism_of(self.sharded)
        rows = strategy.data_coordinates(rank, world, par, recipe.train.micro_batch_size)[2]
        _install_op_info(out)
        self.converter = model_converter(recipe)
        source = ModelSource(None, load=False, shapes_only=True)
        built = build_model(self.ctx, strategy, self.converter, source, plan)
        self.tensors, _ = build_step(self.ctx, strategy, self.converter, built, (rows, recipe.data.seq_len))
        if self.sharded:  # shapes only: MindSpore would otherwise initialise every parameter slice it compiles
            self.tensors.step_cell.no_init_parameters_in_compile()

    def _zeros(self, shape):
        from mindspore import Tensor

        return Tensor(np.zeros(shape, np.int32))

    def compile_train(self):
        """Compile the training step; returns how many (parameter layouts, primitive strategies) the checks
        compared against the plan."""
        from ms_deepseek.train import parallelism

        zeros = self._zeros(self.tensors.input_shape)  # [k * b, T]
        self.tensors.step_cell.compile(zeros, zeros)
        if not self.sharded:
            return 0, 0
        layout = parallelism.checkpoint_layout(self.ctx, self.tensors.opt_tensors)
        return parallelism.check_compiled(self.ctx, self.tensors, layout)

    def run_step(self) -> None:
        """Call the compiled step once (``MS_SIMULATION_LEVEL=1``: no kernels run; MindSpore's memory pool
        accounts each allocation and prints its peak when the process ends). The outputs are placeholders."""
        if os.environ.get("MS_SIMULATION_LEVEL") != "1":
            raise UserError(
                "run_step: only under MS_SIMULATION_LEVEL=1 (a dry run that runs the step without "
                f"kernels); this process has MS_SIMULATION_LEVEL={os.environ.get('MS_SIMULATION_LEVEL')!r}"
            )
        zeros = self._zeros(self.tensors.input_shape)
        self.tensors.step_cell(zeros, zeros)

    def export_program(self, folder: Path) -> Dict[str, object]:
        """``plan --execute``: this rank's compiled training step and its starting values, for the CPU executor
        (:mod:`ms_deepseek.verification.execute.executor`). Compiles the step as :meth:`compile_train` does but keeps the
        ``exec_id`` MindSpore's executor returns (``Cell.compile`` drops it), then reads this rank's slices of
        the weights folder as a sharded run does before step 1 (``parallelism.Sharded.materialize``: the
        optimizer's cut from the compiled layouts, ``converter.load_slices``), initialises what the trainer
        leaves to MindSpore (optimizer moments, accumulation buffers, counters: ``Cell.init_parameters_data``)
        and writes ``program.mindir`` (``_get_func_graph_proto``, the compiled per-rank graph: verification/execute/executor.py),
        ``values.safetensors`` (every parameter of the graph, as this rank holds it before step 1) and
        ``program.json`` (each parameter's compiled layout and optimizer-shard part)."""
        from mindspore.common.api import _cell_graph_executor
        from safetensors.numpy import save_file

        from ms_deepseek.parallel_apply import compiled_check as cc
        from ms_deepseek.train.parallelism import checkpoint_layout

        tensors, par = self.tensors, self.ctx.par
        shape = tensors.input_shape  # [k * b, T]
        zeros = self._zeros(shape)
        exec_id, _ = _cell_graph_executor.compile(tensors.step_cell, zeros, zeros, phase="train")
        program = _cell_graph_executor._get_func_graph_proto(tensors.step_cell, exec_id, "mind_ir")
        (folder / "program.mindir").write_bytes(program)
        layouts = cc.compiled_layouts(tensors.step_cell) or {}
        parts = {}
        if par.optimizer_shard:
            from ms_deepseek.checkpoint.opt_shard import OptimizerShards

            shards = tensors.opt_shards = OptimizerShards.from_compiled(tensors.step_cell)
            parts = {n: [shards.group_rank(g), shards.group_size(g)] for n, g in shards.groups.items()}
        self.converter.load_slices(self.ctx, tensors, checkpoint_layout(self.ctx, tensors.opt_tensors), True)
        values = {}
        for param in tensors.step_cell.get_parameters():
            if param.has_init:
                param.init_data()
            values[param.name] = param.asnumpy()
        save_file({n: np.ascontiguousarray(v) for n, v in values.items()}, str(folder / "values.safetensors"))
        entries = {
            name: {
                "layout": [list(e) if isinstance(e, (list, tuple)) else e for e in entry[:7]],
                "part": parts.get(name),
            }
            for name, entry in layouts.items()
        }
        atomic_write_text(
            folder / "program.json",
            json.dumps({"rank": self.ctx.rank, "input_shape": list(shape), "parameters": entries}, indent=1),
        )
        return {"nodes": len(program), "parameters": len(values)}

    def compile_eval(self) -> None:
        """Compile the validation graph as the trainer's first validation would (one micro-batch)."""
        from ms_deepseek.train.evaluate import Evaluator

        model = self.tensors.model
        evaluator = Evaluator(model, [], self.ctx.world, parallel=self.ctx.par if self.sharded else None)
        if self.sharded:
            evaluator.cell.no_init_parameters_in_compile()
        evaluator.cell.set_train(False)
        zeros = self._zeros((self.tensors.rows, self.tensors.seq_len))  # [b, T]
        evaluator.cell.compile(zeros, zeros)
        model.set_train(True)


def _graph(result: Dict, name: str, fn) -> bool:
    start = time.time()
    entry: Dict[str, object] = {"ok": False}
    result["graphs"][name] = entry
    try:
        value = fn()
        entry["ok"] = True
        if isinstance(value, tuple):  # compile_train: (parameter layouts, primitive strategies) compared
            entry["layouts_compared"], entry["strategies_compared"] = value
    except UserError as e:  # ours: the layout check, or a refusal of the recipe
        entry.update(
            {"error": str(e), "where": "", "kind": "layout" if str(e).startswith("compiled layout") else "refused"}
        )
    except Exception as e:  # MindSpore's compiler
        entry.update(describe_failure(e))
    entry["seconds"] = round(time.time() - start, 1)
    entry["peak_rss_mb"] = round(peak_rss_mb(), 0)
    return bool(entry["ok"])


def run(request_path: str) -> int:
    request = json.loads(Path(request_path).read_text())
    out = Path(request_path).parent
    result: Dict[str, object] = {"rank": int(os.environ.get("RANK_ID", "0")), "graphs": {}}
    start = time.time()
    try:
        from ms_deepseek.config.recipe import recipe_from_request

        try:
            recipe = recipe_from_request(request["recipe"])
            trainer = CompileRun(recipe, out)
        except UserError as e:
            result["graphs"]["setup"] = {"ok": False, "error": str(e), "where": "", "kind": "refused"}
        except Exception as e:
            result["graphs"]["setup"] = {"ok": False, **describe_failure(e)}
        else:
            result["stage"] = trainer.ctx.rank // (recipe.parallel.dp * recipe.parallel.tp)
            if request.get("execute"):
                _graph(result, "export", lambda: trainer.export_program(out))
            elif _graph(result, "train", trainer.compile_train):
                if request.get("memory"):
                    _graph(result, "step", trainer.run_step)
                elif request.get("eval", True):
                    _graph(result, "eval", trainer.compile_eval)
    finally:
        result["seconds"] = round(time.time() - start, 1)
        result["peak_rss_mb"] = round(peak_rss_mb(), 0)
        atomic_write_text(out / "result.json", json.dumps(result, indent=1))
    return 0 if all(g.get("ok") for g in result["graphs"].values()) else 1


if __name__ == "__main__":
    sys.exit(run(sys.argv[1]))
