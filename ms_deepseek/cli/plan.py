"""``ms-deepseek plan``: size a parallel layout for N NPUs (memory, traffic, tokens/s per NPU).

Search (rank the layouts that fit)::

    ms-deepseek plan --model deepseek-v2 --npus 256 --seq-len 4096 --global-batch 1152

Check one layout (any of --dp/--tp/--pp/--ep given; the rest default to 1, dp to the
remaining devices)::

    ms-deepseek plan --model deepseek-v2 --npus 64 --seq-len 4096 --global-batch 80 \\
        --dp 4 --tp 8 --pp 2 --ep 4 --micro-batches 20 --recompute full --optimizer-shard

Check a recipe: ``ms-deepseek plan --recipe recipes/v2-sft-64npu.yaml`` (any of --dp/--tp/--pp/--ep
override the recipe's layout). Neither the recipe's checkpoint nor its data need be on this
machine: the architecture comes from a preset, or from ``<recipe>.config.json`` / ``config.json``
beside the recipe, and the data's shape from ``data.seq_len``.

Simulate a recipe's layout on CPU: ``ms-deepseek plan --recipe R --simulate [--dp 4 --tp 2 --ep 2 --pp 2]``
builds the model at reduced depth and width with the same parallel structure and prints one
line per check (MoE dispatch forward/backward per virtual rank, the rows each rank reads,
pipeline stage contents, loader slices, the parallel-rules lint) with its max error; exit 0 when
every check passes (max error <= 1e-5), 1 when one fails or is not available, 2 on bad input.

``--json`` prints one JSON object (``fits``, ``memory_gb``, ``tokens_per_s_per_npu``, ...).
Exit status: 0 when the answer fits, 1 when it does not, 2 on bad input.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Optional

from ms_deepseek.cli.args import (
    add_all,
    arg,
    non_negative_float,
    non_negative_int,
    overrides_arg,
    positive_float,
    positive_int,
    positive_int_at_most,
)
from ms_deepseek.cli.plan_format import emit
from ms_deepseek.cli.plan_recipe import (
    check_recipe,
    lora_workload,
    parse_stage_layers,
    precision,
    quant_workload,
    read_recipe,
    refuse_invalid,
)
from ms_deepseek.cli.plan_request import PlanRequest
from ms_deepseek.core.errors import UserError
from ms_deepseek.core.schema import MAX_BATCH, MAX_DEVICES, MAX_TOKENS

_COMPILE = "compile (with --recipe): MindSpore's own compiler on the recipe's sharded graphs"
_EXECUTE = "execute (with --recipe): every rank's compiled program run on CPU against one device"
_LAYOUT = "layout (check one layout instead of searching; with --recipe: replace its degrees)"
_MODEL = "model and precision"
_HARDWARE = "hardware (Ascend 910B defaults)"
_EFFICIENCIES = "efficiencies: LOW,HIGH ends of the tokens/s range (docs/planner.md)"

# (argument group title or None for the parser itself, its rows); a group named twice is one group, its
# rows in the order given (argparse's usage line lists the options in that order)
ARGUMENTS = (
    (
        None,
        (
            arg("--model", help="preset name, config.json or checkpoint folder (e.g. deepseek-v2)"),
            arg("--recipe", help="check a training recipe's layout instead of --model/--npus"),
            arg(
                "--simulate",
                action="store_true",
                help="with --recipe: run the CPU simulation of the sharded layout (reduced model, same "
                "dp/tp/ep/pp) and the parallel-rules lint; exit 1 if any check fails",
            ),
        ),
    ),
    (
        _COMPILE,
        (
            arg(
                "--compile",
                action="store_true",
                help="compile the training step and the validation graph of the selected ranks with MindSpore's "
                "dry run (no NPU, weights or data needed; CANN stubs are built on a host without CANN); "
                "exit 1 if a graph does not compile or its layouts differ from the plan",
            ),
            arg(
                "--ranks",
                default="default",
                metavar="SPEC",
                help="ranks to compile: default (the first rank of every pipeline stage and the last rank), "
                "all, last, or a list such as 0,7 or 0-3",
            ),
            arg(
                "--layers",
                type=positive_int,
                metavar="N",
                help="decoder layers to compile (default: the dense layers and one MoE layer per pipeline stage, two with "
                "--memory, at least two MoE layers: a 24 GB host)",
            ),
            arg("--cann", metavar="PATH", help="CANN install to use (default: $ASCEND_HOME_PATH, else stubs)"),
            arg("--no-eval", action="store_true", help="compile the training step only"),
            arg("--keep", metavar="DIR", help="keep each rank's log and result under DIR"),
            arg(
                "--memory",
                action="store_true",
                help="with --compile: MindSpore's dry run at level 1 (MS_SIMULATION_LEVEL=1) compiles the training "
                "step and runs it once without kernels; prints, per selected rank, MindSpore's device-memory "
                "peak and its blocks at the peak beside the planner's estimate for the same reduced model "
                "(weights, optimizer states, gradients, activations, communication), and a linear "
                "extrapolation to the recipe's depth (per layer of the rank's stage, to the recipe's cut) from a "
                "second compile one MoE layer per stage deeper; "
                "nothing is saved; exit 1 if a total differs from the planner's by more than --tolerance",
            ),
            arg(
                "--tolerance",
                type=positive_float,
                default=0.10,
                metavar="FRACTION",
                help="with --memory: the largest |planner / MindSpore - 1| on what both count (default 0.10)",
            ),
        ),
    ),
    (
        _EXECUTE,
        (
            arg(
                "--execute",
                action="store_true",
                help="compile every rank of a reduced copy of the recipe (its own parallel settings, each degree above 1 "
                "cut to 2, at most 3 pipeline stages, a narrow float32 model; it says which), run all ranks' compiled "
                "programs on CPU for --steps optimizer steps with the collectives done between them, and compare "
                "each step's loss, gradient norm, learning rate and every parameter and optimizer state of every rank "
                "with the same reduced model trained on one device; exit 1 at the first difference (named: step, rank, "
                "tensor). Also --cann, --keep",
            ),
            arg(
                "--steps",
                type=positive_int_at_most(8, "optimizer steps executed"),
                default=None,
                metavar="N",
                help="with --execute: optimizer steps to run and compare (default 2)",
            ),
        ),
    ),
    (
        None,
        (
            overrides_arg("recipe override (with --recipe)"),
            arg(
                "--npus", type=positive_int_at_most(MAX_DEVICES, "NPUs in one job"), help="number of NPUs (world size)"
            ),
            arg(
                "--seq-len",
                type=positive_int_at_most(MAX_TOKENS, "tokens of one sequence"),
                help="training sequence length",
            ),
            arg(
                "--global-batch",
                type=positive_int_at_most(MAX_BATCH * MAX_DEVICES, "sequences per step"),
                help="sequences per optimizer step",
            ),
            arg(
                "--micro-batch-size",
                type=positive_int_at_most(MAX_BATCH, "sequences per micro-batch"),
                help="sequences per micro-batch (default 1)",
            ),
        ),
    ),
    (
        _LAYOUT,
        (
            arg("--dp", type=positive_int_at_most(MAX_DEVICES, "NPUs in one job")),
            arg("--tp", type=positive_int_at_most(MAX_DEVICES, "NPUs in one job")),
            arg("--pp", type=positive_int_at_most(MAX_DEVICES, "NPUs in one job")),
            arg("--ep", type=positive_int_at_most(MAX_DEVICES, "NPUs in one job")),
            arg(
                "--micro-batches",
                type=positive_int_at_most(MAX_BATCH, "pipeline micro-batches"),
                help="pipeline micro-batches (default: all of a dp rank's); with --compile: the micro-batches "
                "(pipeline) or accumulation steps compiled (default: pp + 1, or 2)",
            ),
            arg("--recompute", choices=("none", "selective", "full"), default=None),
            arg("--optimizer-shard", action="store_true", help="shard optimizer states across dp"),
            arg("--sequence-parallel", action="store_true"),
            arg("--no-vocab-parallel", action="store_true", help="replicate the embedding and lm_head"),
            arg("--stage-layers", help="layers per pipeline stage, comma-separated"),
        ),
    ),
    (
        _MODEL,
        (
            arg(
                "--compute-dtype",
                choices=("bfloat16", "float16", "float32"),
                help="activation / matmul dtype (default bfloat16; with --recipe: the recipe's)",
            ),
            arg(
                "--param-dtype",
                choices=("bfloat16", "float16", "float32"),
                help="parameter dtype (default: the model config's)",
            ),
            arg(
                "--capacity-factor",
                type=positive_float,
                help="expert capacity factor (default: the model's, else 1.0 as in the paper's training)",
            ),
            arg("--grad-bytes", type=positive_int, help="bytes per gradient element (default: the parameter's)"),
            arg("--optimizer-bytes", type=positive_int, help="optimizer state bytes per element (AdamW fp32: 8)"),
            arg("--master-bytes", type=non_negative_int, help="extra master-weight bytes per element (default 0)"),
            arg("--optimizer-level", choices=("level1", "level2", "level3"), help="default level1"),
            arg(
                "--lora-r",
                type=int,
                help="plan LoRA fine-tuning with adapters of this rank (frozen base: "
                "no gradients or optimizer state for it); with --recipe, replaces the recipe's lora.r",
            ),
            arg(
                "--lora-targets",
                help="comma-separated PEFT target modules (default with --lora-r: the "
                "recipe's, else q_proj,q_a_proj,q_b_proj,kv_a_proj_with_mqa,kv_b_proj,o_proj)",
            ),
            arg("--train-router", action="store_true", help="LoRA: the router weights are trained too"),
            arg(
                "--quant-bits",
                type=int,
                choices=(4, 8),
                help="plan QLoRA: the frozen base stored as int8 (8) "
                "or int4 (4) with scales (needs LoRA); with --recipe, replaces the recipe's quant.bits",
            ),
            arg(
                "--quant-group-size",
                type=positive_int,
                metavar="G",
                help="with --quant-bits: one scale per G input columns (default: the recipe's quant.group_size, "
                "else one scale per output channel)",
            ),
            arg(
                "--flash-attention",
                action="store_true",
                help="assume fused attention (no [T, T] scores kept); the model's default path is eager",
            ),
        ),
    ),
    (
        _HARDWARE,
        (
            arg("--hbm-gb", type=positive_float, help="HBM per NPU (default 64; with --recipe: parallel.hbm_gb)"),
            arg("--peak-tflops", type=positive_float, default=313.0),
        ),
    ),
    (
        _EFFICIENCIES,
        (
            arg(
                "--compute-efficiency",
                metavar="LOW[,HIGH]",
                help="fraction of the peak achieved on executed FLOPs (default: calibrated, costs.LOW / costs.HIGH)",
            ),
            arg("--comm-efficiency", metavar="LOW[,HIGH]", help="fraction of nominal link bandwidth achieved"),
            arg("--overlap", metavar="LOW[,HIGH]", help="fraction of tp/ep communication hidden under compute"),
        ),
    ),
    (
        _HARDWARE,
        (
            arg("--hbm-tbps", type=positive_float, default=1.6),
            arg("--hccs-gbps", type=positive_float, default=56.0, help="per peer inside a node"),
            arg("--roce-gbps", type=positive_float, default=25.0, help="per NPU across nodes"),
            arg("--npus-per-node", type=positive_int, default=8),
            arg("--runtime-reserved-gb", type=positive_float, default=3.0),
            arg("--hccl-buffer-mb", type=non_negative_float, default=200.0),
            arg("--workspace-gb", type=positive_float, default=1.0),
        ),
    ),
    (
        None,
        (
            arg("--top", type=positive_int, help="layouts to list when searching (default 5)"),
            arg("--json", action="store_true", help="print one JSON object"),
        ),
    ),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    groups = {}
    for title, rows in ARGUMENTS:
        if title is None:
            add_all(parser, rows)
            continue
        if title not in groups:
            groups[title] = parser.add_argument_group(title)
        add_all(groups[title], rows)


def _pair(flag: str, text: Optional[str], low: float, high: float, zero_ok: bool):
    """ "a" or "a,b" -> (low, high); each in (0, 1] ([0, 1) for the overlap)."""
    if text is None:
        return low, high
    try:
        values = [float(x) for x in text.split(",")]
    except ValueError:
        raise UserError(f"{flag}: expected LOW or LOW,HIGH numbers, got {text!r}") from None
    if len(values) not in (1, 2):
        raise UserError(f"{flag}: expected LOW or LOW,HIGH, got {text!r}")
    for v in values:
        if not ((0 <= v < 1) if zero_ok else (0 < v <= 1)):
            raise UserError(f"{flag}: must be in {'[0, 1)' if zero_ok else '(0, 1]'}, got {v}")
    return values[0], values[-1]


def _hardware(req: PlanRequest):
    from ms_deepseek.parallel_plan.costs import HIGH, LOW, Hardware

    compute = _pair("--compute-efficiency", req.compute_efficiency, LOW.compute, HIGH.compute, False)
    comm = _pair("--comm-efficiency", req.comm_efficiency, LOW.comm, HIGH.comm, False)
    overlap = _pair("--overlap", req.overlap, LOW.overlap, HIGH.overlap, True)
    low = dataclasses.replace(LOW, compute=compute[0], comm=comm[0], overlap=overlap[0])
    high = dataclasses.replace(HIGH, compute=compute[1], comm=comm[1], overlap=overlap[1])
    return Hardware(
        hbm_gb=req.hbm_gb or 64.0,
        peak_tflops=req.peak_tflops,
        hbm_tbps=req.hbm_tbps,
        hccs_gbps=req.hccs_gbps,
        roce_gbps=req.roce_gbps,
        npus_per_node=req.npus_per_node,
        runtime_reserved_gb=req.runtime_reserved_gb,
        hccl_buffer_mb=req.hccl_buffer_mb,
        workspace_gb=req.workspace_gb,
        low=low,
        high=high,
    )


def _model(req: PlanRequest):
    from ms_deepseek.config.model import load_model_config

    cfg = load_model_config(req.model)
    changes = {"compute_dtype": req.compute_dtype or "bfloat16"}
    if req.param_dtype:
        changes["param_dtype"] = req.param_dtype
    if req.capacity_factor is not None:
        changes["capacity_factor"] = req.capacity_factor
    elif cfg.has_moe and cfg.capacity_factor is None:
        changes["capacity_factor"] = 1.0
    return cfg.replace(**changes)


def _layout(req: PlanRequest, npus: int, global_batch: int):
    from ms_deepseek.config.parallel import ParallelConfig

    tp, pp, ep = req.tp or 1, req.pp or 1, req.ep or 1
    if req.dp is None:
        if npus % (tp * pp):
            raise UserError(f"--npus {npus} is not divisible by tp*pp = {tp * pp}")
        dp = npus // (tp * pp)
    else:
        dp = req.dp
    micro = req.micro_batches
    if micro is None:
        per_rank = global_batch // max(1, dp * (req.micro_batch_size or 1))
        micro = per_rank if pp > 1 else 1
    stage_layers = parse_stage_layers(req.stage_layers) if req.stage_layers else None
    return ParallelConfig(
        dp=dp,
        tp=tp,
        pp=pp,
        ep=ep,
        micro_batches=max(1, micro),
        recompute=req.recompute or "none",
        optimizer_shard=req.optimizer_shard,
        sequence_parallel=req.sequence_parallel,
        vocab_parallel=not req.no_vocab_parallel,
        stage_layers=stage_layers,
        hbm_gb=req.hbm_gb or 64.0,
    )


def _positive(req: PlanRequest, *keys):
    for key in keys:
        value = getattr(req, key)
        if value is None:
            raise UserError(f"--{key.replace('_', '-')}: required (or pass --recipe)")
        if value < 1:
            raise UserError(f"--{key.replace('_', '-')}: must be >= 1, got {value}")


def run(args: argparse.Namespace) -> int:
    req = PlanRequest.from_args(args)  # the edge: nothing below reads the namespace
    hw = _hardware(req)
    _refuse_misplaced_flags(req)
    if req.execute:
        from ms_deepseek.cli.plan_checks import run_execute

        return run_execute(req, hw)
    if req.compile:
        from ms_deepseek.cli.plan_checks import run_compile

        return run_compile(req, hw)
    if req.recipe:
        return _run_recipe(req, hw)
    return _run_model(req, hw)


def _refuse_misplaced_flags(req: PlanRequest) -> None:
    """Flags given where they mean nothing (or with a check they cannot join) are bad input."""
    if req.simulate and not req.recipe:
        raise UserError("--simulate: needs --recipe RECIPE (the model, sequence length and layout to simulate)")
    if req.memory and not req.compile:
        raise UserError("--memory: only with --compile (MindSpore's level-1 dry run of the recipe's step)")
    if req.tolerance != 0.10 and not req.memory:
        raise UserError("--tolerance: only with --compile --memory")
    if req.steps is not None and not req.execute:
        raise UserError("--steps: only with --execute")
    if req.execute:
        _refuse_with_execute(req)
        return
    if not req.compile:
        for flag in ("layers", "cann", "keep"):
            if getattr(req, flag) is not None:
                raise UserError(f"--{flag}: only with --compile or --execute")
        if req.ranks != "default" or req.no_eval:
            raise UserError(f"--{'ranks' if req.ranks != 'default' else 'no-eval'}: only with --compile")
    if req.compile:
        if not req.recipe:
            raise UserError("--compile: needs --recipe RECIPE (the recipe whose graphs MindSpore compiles)")
        if req.simulate:
            raise UserError("--compile and --simulate: one at a time")


def _refuse_with_execute(req: PlanRequest) -> None:
    if not req.recipe:
        raise UserError("--execute: needs --recipe RECIPE (the recipe whose ranks are executed)")
    for flag, on in (("compile", req.compile), ("simulate", req.simulate), ("memory", req.memory)):
        if on:
            raise UserError(f"--execute and --{flag}: one at a time")
    for flag in ("layers", "micro_batches"):
        if getattr(req, flag) is not None:
            raise UserError(f"--{flag.replace('_', '-')}: not with --execute (it chooses its own reduction)")
    if req.ranks != "default" or req.no_eval:
        raise UserError(f"--{'ranks' if req.ranks != 'default' else 'no-eval'}: not with --execute (every rank runs)")


def _run_recipe(req: PlanRequest, hw) -> int:
    """``--recipe R``: the planner's verdict on the recipe's layout (or, with --simulate, the CPU simulation)."""
    result, recipe, note = check_recipe(req, hw, read_recipe(req))
    refuse_invalid(result)
    if req.simulate:
        return _simulate(req, recipe, result)
    emit(req, result, None)
    if note and not req.json:
        print(note)
    return 0 if result.fits else 1


def _run_model(req: PlanRequest, hw) -> int:
    """``--model M --npus N ...``: one layout checked (any of --dp/--tp/--pp/--ep given), else a search."""
    from ms_deepseek.parallel_plan.planner import estimate, search
    from ms_deepseek.parallel_plan.workload import Workload

    if not req.model:
        raise UserError("--model: required (a preset, config.json or checkpoint folder), or pass --recipe")
    req = dataclasses.replace(req, micro_batch_size=req.micro_batch_size or 1)
    _positive(req, "npus", "seq_len", "global_batch", "micro_batch_size")
    cfg = _model(req)
    prec = precision(req, cfg)
    lora = lora_workload(req, None)
    workload = Workload(
        seq_len=req.seq_len,
        global_batch_size=req.global_batch,
        micro_batch_size=req.micro_batch_size,
        flash_attention=req.flash_attention,
        lora=lora,
        quant=quant_workload(req, None, lora),
    )
    if any(getattr(req, k) is not None for k in ("dp", "tp", "pp", "ep")):
        layout = _layout(req, req.npus, req.global_batch)
        result = estimate(cfg, layout, workload, prec, hw, world_size=req.npus)
        refuse_invalid(result)
        emit(req, result, None)
        return 0 if result.fits else 1
    ranked = search(
        cfg,
        req.npus,
        workload,
        prec,
        hw,
        top=max(1, req.top or 5),
        progress=True,
        announce=lambda n: print(f"plan: estimating {n} layouts of {req.npus} NPUs ...", file=sys.stderr, flush=True),
    )
    emit(req, ranked[0], ranked)
    return 0 if ranked[0].fits else 1


def _simulate(req: PlanRequest, recipe, result) -> int:
    """The planner's verdict, then the simulation's lines; the exit status is the simulation's."""
    from ms_deepseek.simulation.simulate import all_passed, format_results, simulate

    if not req.json:
        emit(req, result, None)
    results = simulate(recipe.model_config, recipe.parallel, recipe.seq_len, recipe.train.micro_batch_size)
    if req.json:
        out = result.to_dict()
        out["simulation"] = [
            {"check": r.name, "status": r.status, "max_err": r.max_err, "detail": r.detail} for r in results
        ]
        out["simulation_passed"] = all_passed(results)
        print(json.dumps(out, indent=2))
    else:
        print(format_results(results))
    return 0 if all_passed(results) else 1
