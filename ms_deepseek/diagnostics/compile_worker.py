"""One simulated rank of the compile check: MindSpore's dry run compiles the recipe's graphs.

Run by :mod:`ms_deepseek.diagnostics.compile_check` as
``python -m ms_deepseek.diagnostics.compile_worker REQUEST.json`` in a process whose environment
holds MindSpore's dry run (``MS_SIMULATION_LEVEL=0``, ``RANK_SIZE`` / ``RANK_ID`` of the simulated
world, ``MS_DEEPSEEK_DEVICE=Ascend``) and CANN's libraries or their stubs
(:mod:`ms_deepseek.diagnostics.cann_stubs`).

It runs the trainer's own set-up (:class:`ms_deepseek.train.trainer.Trainer`: layout checks,
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

from ms_deepseek.core.errors import UserError
from ms_deepseek.train.trainer import Trainer

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


class CompileOnlyTrainer(Trainer):
    """The trainer's set-up without data, weights or steps; :meth:`compile_all` compiles its graphs."""

    def _check_layout(self) -> None:
        # as Trainer, minus what is about the machine: the planner's fit is reported, not enforced
        from ms_deepseek.train.trainer import fit_plan

        self.plan = fit_plan(self.recipe, force=True)

    def _setup_run(self) -> None:
        from ms_deepseek.core.runtime import use_device
        from ms_deepseek.train.trainer import init_distributed, is_distributed

        use_device()
        self.rank, self.world = init_distributed(self.par) if is_distributed() else (0, 1)
        self.is_main = False
        self.resume_dir, self.state, self.start_step, self.complete = None, {}, 0, False
        self.total = self.stop_at = self.recipe.train.steps

    def _build_data(self) -> None:
        from ms_deepseek.parallel_plan.ranks import data_coordinates

        mb = self.recipe.train.micro_batch_size
        self.rows = data_coordinates(self.rank, self.par, mb)[2] if self.sharded else mb
        self.seq_len = self.recipe.data.seq_len

    def _build_model(self) -> None:
        import mindspore as ms
        from mindspore.nn.utils import no_init_parameters

        from ms_deepseek.model.causal_lm import DeepseekV2ForCausalLM
        from ms_deepseek.parallel_apply.apply import apply_plan
        from ms_deepseek.parallel_plan.memory import reserve_device_memory
        from ms_deepseek.parallel_plan.ranks import stage_of_rank

        _install_op_info(self.run_dir)
        ms.set_seed(self.recipe.train.seed)
        with no_init_parameters():  # shapes only: nothing allocated, nothing read
            model = DeepseekV2ForCausalLM(self.cfg)
        if self.recipe.lora is not None:
            from ms_deepseek.train import lora_run

            lora_run.prepare(model, self.recipe, self.run_dir, write_base=False, sharded=True, shapes_only=True)
        model.set_train(True)
        self.applied = apply_plan(model, self.par, self.cfg)
        if self.par.reserve_memory:
            reserve_device_memory(
                self.plan,
                self.par.memory_headroom_gb,
                hbm_gb=self.par.hbm_gb,
                stage=stage_of_rank(self.rank, self.par) if self.par.pp > 1 else None,
            )
        self.model = model

    def _build_step(self) -> None:
        super()._build_step()
        if self.sharded:  # shapes only: MindSpore would otherwise initialise every parameter slice it compiles
            self.step_cell.no_init_parameters_in_compile()

    def compile_train(self):
        """Compile the training step; returns how many (parameter layouts, primitive strategies) the checks
        compared against the plan."""
        from mindspore import Tensor

        from ms_deepseek.parallel_apply import compiled_check as cc
        from ms_deepseek.parallel_plan.ranks import stage_of_rank

        shape = (self.k * self.rows, self.seq_len)  # [k * b, T]
        self.step_cell.compile(Tensor(np.zeros(shape, np.int32)), Tensor(np.zeros(shape, np.int32)))
        if not self.sharded:
            return 0, 0
        compared = cc.check_parameter_layouts(
            cc.compiled_layouts(self.step_cell), self._layout(), self.rank, self.par.optimizer_shard
        )
        self.strategies_compared = cc.check_compiled_strategies(
            cc.compiled_strategies(self.step_cell),
            cc.planned_primitives(
                self.model, self.applied.strategies, self.applied.stage_of_cell, stage_of_rank(self.rank, self.par)
            ),
        )
        return compared, self.strategies_compared

    def run_step(self) -> None:
        """Call the compiled step once (``MS_SIMULATION_LEVEL=1``: no kernels run; MindSpore's memory pool
        accounts each allocation and prints its peak when the process ends). The outputs are placeholders."""
        from mindspore import Tensor

        if os.environ.get("MS_SIMULATION_LEVEL") != "1":
            raise UserError(
                "run_step: only under MS_SIMULATION_LEVEL=1 (a dry run that runs the step without "
                f"kernels); this process has MS_SIMULATION_LEVEL={os.environ.get('MS_SIMULATION_LEVEL')!r}"
            )
        shape = (self.k * self.rows, self.seq_len)
        self.step_cell(Tensor(np.zeros(shape, np.int32)), Tensor(np.zeros(shape, np.int32)))

    def export_program(self, folder: Path) -> Dict[str, object]:
        """``plan --execute``: this rank's compiled training step and its starting values, for the CPU executor
        (:mod:`ms_deepseek.diagnostics.execute`). Compiles the step as :meth:`compile_train` does but keeps the
        ``exec_id`` MindSpore's executor returns (``Cell.compile`` drops it), then reads this rank's slices of
        the weights folder as a sharded run does before step 1 (``parallelism.Sharded.prepare_restore``: the
        optimizer's cut from the compiled layouts, ``converter.load_slices``), initialises what the trainer
        leaves to MindSpore (optimizer moments, accumulation buffers, counters: ``Cell.init_parameters_data``)
        and writes ``program.mindir`` (``_get_func_graph_proto``, the compiled per-rank graph: diagnostics/execute.py),
        ``values.safetensors`` (every parameter of the graph, as this rank holds it before step 1) and
        ``program.json`` (each parameter's compiled layout and optimizer-shard part)."""
        from mindspore import Tensor
        from mindspore.common.api import _cell_graph_executor
        from safetensors.numpy import save_file

        from ms_deepseek.parallel_apply import compiled_check as cc

        shape = (self.k * self.rows, self.seq_len)  # [k * b, T]
        zeros = Tensor(np.zeros(shape, np.int32))
        exec_id, _ = _cell_graph_executor.compile(self.step_cell, zeros, zeros, phase="train")
        program = _cell_graph_executor._get_func_graph_proto(self.step_cell, exec_id, "mind_ir")
        (folder / "program.mindir").write_bytes(program)
        layouts = cc.compiled_layouts(self.step_cell) or {}
        parts = {}
        if self.par.optimizer_shard:
            from ms_deepseek.checkpoint.opt_shard import OptimizerShards

            self.opt_shards = OptimizerShards.from_compiled(self.step_cell)
            parts = {
                n: [self.opt_shards.group_rank(g), self.opt_shards.group_size(g)]
                for n, g in self.opt_shards.groups.items()
            }
        self.resume_dir = None
        self.converter.load_slices(self, self._layout())
        values = {}
        for param in self.step_cell.get_parameters():
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
        (folder / "program.json").write_text(
            json.dumps({"rank": self.rank, "input_shape": list(shape), "parameters": entries}, indent=1)
        )
        return {"nodes": len(program), "parameters": len(values)}

    def compile_eval(self) -> None:
        """Compile the validation graph as the trainer's first validation would (one micro-batch)."""
        from mindspore import Tensor

        from ms_deepseek.train.evaluate import Evaluator

        evaluator = Evaluator(self.model, [], self.world, parallel=self.par if self.sharded else None)
        if self.sharded:
            evaluator.cell.no_init_parameters_in_compile()
        evaluator.cell.set_train(False)
        shape = (self.rows, self.seq_len)  # [b, T]
        evaluator.cell.compile(Tensor(np.zeros(shape, np.int32)), Tensor(np.zeros(shape, np.int32)))
        self.model.set_train(True)


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
        from ms_deepseek.config.recipe import load_recipe, planning_config_path

        try:
            recipe = load_recipe(
                request["recipe"], request.get("overrides", []), planning_config_path(request["recipe"])
            )
            trainer = CompileOnlyTrainer(recipe, out, None, True, False, None)
            trainer._check_layout()
            trainer._setup_run()
            trainer._build_data()
            trainer._build_model()
            trainer._build_step()
        except UserError as e:
            result["graphs"]["setup"] = {"ok": False, "error": str(e), "where": "", "kind": "refused"}
        except Exception as e:
            result["graphs"]["setup"] = {"ok": False, **describe_failure(e)}
        else:
            result["stage"] = trainer.rank // (trainer.par.dp * trainer.par.tp)
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
        tmp = out / ".result.json.tmp"
        tmp.write_text(json.dumps(result, indent=1))
        os.replace(tmp, out / "result.json")
    return 0 if all(g.get("ok") for g in result["graphs"].values()) else 1


if __name__ == "__main__":
    sys.exit(run(sys.argv[1]))
