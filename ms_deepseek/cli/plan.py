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
import os
import sys
from pathlib import Path
from typing import List, Optional

from ms_deepseek.cli.args import (
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
    positive_int_at_most,
    resolve_layout,
)
from ms_deepseek.core.errors import UserError
from ms_deepseek.core.schema import MAX_BATCH, MAX_DEVICES, MAX_TOKENS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="preset name, config.json or checkpoint folder (e.g. deepseek-v2)")
    parser.add_argument("--recipe", help="check a training recipe's layout instead of --model/--npus")
    parser.add_argument(
        "--simulate",
        action="store_true",
        help="with --recipe: run the CPU simulation of the sharded layout (reduced model, same "
        "dp/tp/ep/pp) and the parallel-rules lint; exit 1 if any check fails",
    )
    c = parser.add_argument_group("compile (with --recipe): MindSpore's own compiler on the recipe's sharded graphs")
    c.add_argument(
        "--compile",
        action="store_true",
        help="compile the training step and the validation graph of the selected ranks with MindSpore's "
        "dry run (no NPU, weights or data needed; CANN stubs are built on a host without CANN); "
        "exit 1 if a graph does not compile or its layouts differ from the plan",
    )
    c.add_argument(
        "--ranks",
        default="default",
        metavar="SPEC",
        help="ranks to compile: default (the first rank of every pipeline stage and the last rank), "
        "all, last, or a list such as 0,7 or 0-3",
    )
    c.add_argument(
        "--layers",
        type=positive_int,
        metavar="N",
        help="decoder layers to compile (default: the dense layers and one MoE layer per pipeline stage, two with "
        "--memory, at least two MoE layers: a 24 GB host)",
    )
    c.add_argument("--cann", metavar="PATH", help="CANN install to use (default: $ASCEND_HOME_PATH, else stubs)")
    c.add_argument("--no-eval", action="store_true", help="compile the training step only")
    c.add_argument("--keep", metavar="DIR", help="keep each rank's log and result under DIR")
    c.add_argument(
        "--memory",
        action="store_true",
        help="with --compile: MindSpore's dry run at level 1 (MS_SIMULATION_LEVEL=1) compiles the training "
        "step and runs it once without kernels; prints, per selected rank, MindSpore's device-memory "
        "peak and its blocks at the peak beside the planner's estimate for the same reduced model "
        "(weights, optimizer states, gradients, activations, communication), and a linear "
        "extrapolation to the recipe's depth (per layer of the rank's stage, to the recipe's cut) from a "
        "second compile one MoE layer per stage deeper; "
        "nothing is saved; exit 1 if a total differs from the planner's by more than --tolerance",
    )
    c.add_argument(
        "--tolerance",
        type=positive_float,
        default=0.10,
        metavar="FRACTION",
        help="with --memory: the largest |planner / MindSpore - 1| on what both count (default 0.10)",
    )
    x = parser.add_argument_group(
        "execute (with --recipe): every rank's compiled program run on CPU against one device"
    )
    x.add_argument(
        "--execute",
        action="store_true",
        help="compile every rank of a reduced copy of the recipe (its own parallel settings, each degree above 1 "
        "cut to 2, at most 3 pipeline stages, a narrow float32 model; it says which), run all ranks' compiled "
        "programs on CPU for --steps optimizer steps with the collectives done between them, and compare "
        "each step's loss, gradient norm, learning rate and every parameter and optimizer state of every rank "
        "with the same reduced model trained on one device; exit 1 at the first difference (named: step, rank, "
        "tensor). Also --cann, --keep",
    )
    x.add_argument(
        "--steps",
        type=positive_int_at_most(8, "optimizer steps executed"),
        default=None,
        metavar="N",
        help="with --execute: optimizer steps to run and compare (default 2)",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="recipe override (with --recipe)",
    )
    parser.add_argument(
        "--npus", type=positive_int_at_most(MAX_DEVICES, "NPUs in one job"), help="number of NPUs (world size)"
    )
    parser.add_argument(
        "--seq-len", type=positive_int_at_most(MAX_TOKENS, "tokens of one sequence"), help="training sequence length"
    )
    parser.add_argument(
        "--global-batch",
        type=positive_int_at_most(MAX_BATCH * MAX_DEVICES, "sequences per step"),
        help="sequences per optimizer step",
    )
    parser.add_argument(
        "--micro-batch-size",
        type=positive_int_at_most(MAX_BATCH, "sequences per micro-batch"),
        help="sequences per micro-batch (default 1)",
    )
    g = parser.add_argument_group("layout (check one layout instead of searching; with --recipe: replace its degrees)")
    for flag in ("--dp", "--tp", "--pp", "--ep"):
        g.add_argument(flag, type=positive_int_at_most(MAX_DEVICES, "NPUs in one job"))
    g.add_argument(
        "--micro-batches",
        type=positive_int_at_most(MAX_BATCH, "pipeline micro-batches"),
        help="pipeline micro-batches (default: all of a dp rank's); with --compile: the micro-batches "
        "(pipeline) or accumulation steps compiled (default: pp + 1, or 2)",
    )
    g.add_argument("--recompute", choices=("none", "selective", "full"), default=None)
    g.add_argument("--optimizer-shard", action="store_true", help="shard optimizer states across dp")
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--no-vocab-parallel", action="store_true", help="replicate the embedding and lm_head")
    g.add_argument("--stage-layers", help="layers per pipeline stage, comma-separated")
    m = parser.add_argument_group("model and precision")
    m.add_argument(
        "--compute-dtype",
        choices=("bfloat16", "float16", "float32"),
        help="activation / matmul dtype (default bfloat16; with --recipe: the recipe's)",
    )
    m.add_argument(
        "--param-dtype",
        choices=("bfloat16", "float16", "float32"),
        help="parameter dtype (default: the model config's)",
    )
    m.add_argument(
        "--capacity-factor",
        type=positive_float,
        help="expert capacity factor (default: the model's, else 1.0 as in the paper's training)",
    )
    m.add_argument("--grad-bytes", type=positive_int, help="bytes per gradient element (default: the parameter's)")
    m.add_argument("--optimizer-bytes", type=positive_int, help="optimizer state bytes per element (AdamW fp32: 8)")
    m.add_argument("--master-bytes", type=non_negative_int, help="extra master-weight bytes per element (default 0)")
    m.add_argument("--optimizer-level", choices=("level1", "level2", "level3"), help="default level1")
    m.add_argument(
        "--lora-r",
        type=int,
        help="plan LoRA fine-tuning with adapters of this rank (frozen base: "
        "no gradients or optimizer state for it); with --recipe, replaces the recipe's lora.r",
    )
    m.add_argument(
        "--lora-targets",
        help="comma-separated PEFT target modules (default with --lora-r: the "
        "recipe's, else q_proj,q_a_proj,q_b_proj,kv_a_proj_with_mqa,kv_b_proj,o_proj)",
    )
    m.add_argument("--train-router", action="store_true", help="LoRA: the router weights are trained too")
    m.add_argument(
        "--quant-bits",
        type=int,
        choices=(4, 8),
        help="plan QLoRA: the frozen base stored as int8 (8) "
        "or int4 (4) with scales (needs LoRA); with --recipe, replaces the recipe's quant.bits",
    )
    m.add_argument(
        "--quant-group-size",
        type=positive_int,
        metavar="G",
        help="with --quant-bits: one scale per G input columns (default: the recipe's quant.group_size, "
        "else one scale per output channel)",
    )
    m.add_argument(
        "--flash-attention",
        action="store_true",
        help="assume fused attention (no [T, T] scores kept); the model's default path is eager",
    )
    h = parser.add_argument_group("hardware (Ascend 910B defaults)")
    h.add_argument("--hbm-gb", type=positive_float, help="HBM per NPU (default 64; with --recipe: parallel.hbm_gb)")
    h.add_argument("--peak-tflops", type=positive_float, default=313.0)
    e = parser.add_argument_group("efficiencies: LOW,HIGH ends of the tokens/s range (docs/planner.md)")
    e.add_argument(
        "--compute-efficiency",
        metavar="LOW[,HIGH]",
        help="fraction of the peak achieved on executed FLOPs (default: calibrated, costs.LOW / costs.HIGH)",
    )
    e.add_argument("--comm-efficiency", metavar="LOW[,HIGH]", help="fraction of nominal link bandwidth achieved")
    e.add_argument("--overlap", metavar="LOW[,HIGH]", help="fraction of tp/ep communication hidden under compute")
    h.add_argument("--hbm-tbps", type=positive_float, default=1.6)
    h.add_argument("--hccs-gbps", type=positive_float, default=56.0, help="per peer inside a node")
    h.add_argument("--roce-gbps", type=positive_float, default=25.0, help="per NPU across nodes")
    h.add_argument("--npus-per-node", type=positive_int, default=8)
    h.add_argument("--runtime-reserved-gb", type=positive_float, default=3.0)
    h.add_argument("--hccl-buffer-mb", type=non_negative_float, default=200.0)
    h.add_argument("--workspace-gb", type=positive_float, default=1.0)
    parser.add_argument("--top", type=positive_int, help="layouts to list when searching (default 5)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


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


def _hardware(args):
    import dataclasses

    from ms_deepseek.parallel_plan.costs import HIGH, LOW, Hardware

    compute = _pair("--compute-efficiency", args.compute_efficiency, LOW.compute, HIGH.compute, False)
    comm = _pair("--comm-efficiency", args.comm_efficiency, LOW.comm, HIGH.comm, False)
    overlap = _pair("--overlap", args.overlap, LOW.overlap, HIGH.overlap, True)
    low = dataclasses.replace(LOW, compute=compute[0], comm=comm[0], overlap=overlap[0])
    high = dataclasses.replace(HIGH, compute=compute[1], comm=comm[1], overlap=overlap[1])
    return Hardware(
        hbm_gb=args.hbm_gb or 64.0,
        peak_tflops=args.peak_tflops,
        hbm_tbps=args.hbm_tbps,
        hccs_gbps=args.hccs_gbps,
        roce_gbps=args.roce_gbps,
        npus_per_node=args.npus_per_node,
        runtime_reserved_gb=args.runtime_reserved_gb,
        hccl_buffer_mb=args.hccl_buffer_mb,
        workspace_gb=args.workspace_gb,
        low=low,
        high=high,
    )


def _precision(args, cfg):
    from ms_deepseek.core.dtypes import itemsize
    from ms_deepseek.parallel_plan.costs import Precision

    return Precision(
        compute_bytes=itemsize(cfg.compute_dtype),
        grad_bytes=args.grad_bytes,
        optimizer_bytes=8 if args.optimizer_bytes is None else args.optimizer_bytes,
        master_bytes=args.master_bytes or 0,
        optimizer_level=args.optimizer_level or "level1",
    )


def _model(args):
    from ms_deepseek.config.model import load_model_config

    cfg = load_model_config(args.model)
    changes = {"compute_dtype": args.compute_dtype or "bfloat16"}
    if args.param_dtype:
        changes["param_dtype"] = args.param_dtype
    if args.capacity_factor is not None:
        changes["capacity_factor"] = args.capacity_factor
    elif cfg.has_moe and cfg.capacity_factor is None:
        changes["capacity_factor"] = 1.0
    return cfg.replace(**changes)


def _layout(args, npus: int, global_batch: int):
    from ms_deepseek.config.parallel import ParallelConfig

    tp, pp, ep = args.tp or 1, args.pp or 1, args.ep or 1
    if args.dp is None:
        if npus % (tp * pp):
            raise UserError(f"--npus {npus} is not divisible by tp*pp = {tp * pp}")
        dp = npus // (tp * pp)
    else:
        dp = args.dp
    micro = args.micro_batches
    if micro is None:
        per_rank = global_batch // max(1, dp * (args.micro_batch_size or 1))
        micro = per_rank if pp > 1 else 1
    stage_layers = _stage_layers(args.stage_layers) if args.stage_layers else None
    return ParallelConfig(
        dp=dp,
        tp=tp,
        pp=pp,
        ep=ep,
        micro_batches=max(1, micro),
        recompute=args.recompute or "none",
        optimizer_shard=args.optimizer_shard,
        sequence_parallel=args.sequence_parallel,
        vocab_parallel=not args.no_vocab_parallel,
        stage_layers=stage_layers,
        hbm_gb=args.hbm_gb or 64.0,
    )


def _stage_layers(text: str) -> List[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise UserError(f"--stage-layers: expected comma-separated integers, got {text!r}") from None


def _positive(args, *keys):
    for key in keys:
        value = getattr(args, key)
        if value is None:
            raise UserError(f"--{key.replace('_', '-')}: required (or pass --recipe)")
        if value < 1:
            raise UserError(f"--{key.replace('_', '-')}: must be >= 1, got {value}")


def _refuse_invalid(result) -> None:
    """An invalid layout is bad input (exit 2, on stderr), not an answer that does not fit."""
    if result.problems:
        raise UserError(f"invalid layout {result.layout.describe()}: " + "; ".join(result.problems))


def run(args: argparse.Namespace) -> int:
    from ms_deepseek.parallel_plan.costs import Workload
    from ms_deepseek.parallel_plan.planner import estimate, search

    hw = _hardware(args)
    if args.simulate and not args.recipe:
        raise UserError("--simulate: needs --recipe RECIPE (the model, sequence length and layout to simulate)")
    if args.memory and not args.compile:
        raise UserError("--memory: only with --compile (MindSpore's level-1 dry run of the recipe's step)")
    if args.tolerance != 0.10 and not args.memory:
        raise UserError("--tolerance: only with --compile --memory")
    if args.steps is not None and not args.execute:
        raise UserError("--steps: only with --execute")
    if args.execute:
        if not args.recipe:
            raise UserError("--execute: needs --recipe RECIPE (the recipe whose ranks are executed)")
        for flag, on in (("compile", args.compile), ("simulate", args.simulate), ("memory", args.memory)):
            if on:
                raise UserError(f"--execute and --{flag}: one at a time")
        for flag in ("layers", "micro_batches"):
            if getattr(args, flag) is not None:
                raise UserError(f"--{flag.replace('_', '-')}: not with --execute (it chooses its own reduction)")
        if args.ranks != "default" or args.no_eval:
            raise UserError(
                f"--{'ranks' if args.ranks != 'default' else 'no-eval'}: not with --execute (every rank runs)"
            )
        return _execute(args, hw)
    if not args.compile:
        for flag in ("layers", "cann", "keep"):
            if getattr(args, flag) is not None:
                raise UserError(f"--{flag}: only with --compile or --execute")
        if args.ranks != "default" or args.no_eval:
            raise UserError(f"--{'ranks' if args.ranks != 'default' else 'no-eval'}: only with --compile")
    if args.compile:
        if not args.recipe:
            raise UserError("--compile: needs --recipe RECIPE (the recipe whose graphs MindSpore compiles)")
        if args.simulate:
            raise UserError("--compile and --simulate: one at a time")
        return _compile(args, hw)
    if args.recipe:
        result, recipe, note = _check_recipe(args, hw)
        _refuse_invalid(result)
        if args.simulate:
            return _simulate(args, recipe, result)
        _emit(args, result, None)
        if note and not args.json:
            print(note)
        return 0 if result.fits else 1
    if not args.model:
        raise UserError("--model: required (a preset, config.json or checkpoint folder), or pass --recipe")
    args.micro_batch_size = args.micro_batch_size or 1
    _positive(args, "npus", "seq_len", "global_batch", "micro_batch_size")
    cfg = _model(args)
    precision = _precision(args, cfg)
    lora = _lora(args, None)
    workload = Workload(
        seq_len=args.seq_len,
        global_batch_size=args.global_batch,
        micro_batch_size=args.micro_batch_size,
        flash_attention=args.flash_attention,
        lora=lora,
        quant=_quant(args, None, lora),
    )
    if any(getattr(args, k) is not None for k in ("dp", "tp", "pp", "ep")):
        layout = _layout(args, args.npus, args.global_batch)
        result = estimate(cfg, layout, workload, precision, hw, world_size=args.npus)
        _refuse_invalid(result)
        _emit(args, result, None)
        return 0 if result.fits else 1
    ranked = search(
        cfg,
        args.npus,
        workload,
        precision,
        hw,
        top=max(1, args.top or 5),
        progress=True,
        announce=lambda n: print(f"plan: estimating {n} layouts of {args.npus} NPUs ...", file=sys.stderr, flush=True),
    )
    _emit(args, ranked[0], ranked)
    return 0 if ranked[0].fits else 1


def _lora(args, section):
    """The LoRA workload from --lora-r / --lora-targets / --train-router over the recipe's section."""
    from ms_deepseek.config.lora import DEFAULT_TARGETS, LORA_TARGETS, LoraSpec

    if args.lora_r is None and args.lora_targets is None and section is None:
        if args.train_router:
            raise UserError("--train-router: only with LoRA (--lora-r or a recipe lora: section)")
        return None
    r = args.lora_r if args.lora_r is not None else (section.r if section is not None else None)
    if r is None:
        raise UserError("--lora-targets: needs --lora-r (the adapter rank)")
    if r < 1:
        raise UserError(f"--lora-r: must be >= 1, got {r}")
    if args.lora_targets is not None:
        targets = tuple(t.strip() for t in args.lora_targets.split(",") if t.strip())
        for t in targets:
            if t.rsplit(".", 1)[-1] not in LORA_TARGETS:
                raise UserError(f"--lora-targets: unknown target module {t!r}; known: {', '.join(LORA_TARGETS)}")
        if not targets:
            raise UserError("--lora-targets: empty")
    else:
        targets = tuple(section.target_modules) if section is not None else DEFAULT_TARGETS
    train_router = args.train_router or bool(section is not None and section.train_router)
    # the section's dropout sizes activations too (costs.lora_dropout_bytes); --lora-r alone: none
    dropout = section.dropout if section is not None else 0.0
    return LoraSpec(r=int(r), dropout=dropout, target_modules=list(targets), train_router=train_router)


def _quant(args, section, lora):
    """The quantized base from --quant-bits / --quant-group-size over the recipe's ``quant:`` section."""
    from ms_deepseek.config.quant import QuantSpec

    if args.quant_bits is None and args.quant_group_size is None:
        return section
    bits = args.quant_bits if args.quant_bits is not None else (section.bits if section is not None else None)
    if bits is None:
        raise UserError("--quant-group-size: needs --quant-bits (4 or 8)")
    if lora is None:
        raise UserError("--quant-bits: only with LoRA (--lora-r or a recipe lora: section): a quantized base is frozen")
    group = args.quant_group_size
    if group is None and section is not None:
        group = section.group_size
    try:
        return QuantSpec(bits=bits, group_size=group)
    except UserError as exc:
        raise UserError(str(exc).replace("quant.group_size:", "--quant-group-size:", 1)) from None


# plan flags that stand for a recipe key: with --recipe they are applied as that --set
_AS_SET = {
    "recompute": lambda v: f"parallel.recompute={v}",
    "optimizer_shard": lambda v: "parallel.optimizer_shard=true",
    "sequence_parallel": lambda v: "parallel.sequence_parallel=true",
    "no_vocab_parallel": lambda v: "parallel.vocab_parallel=false",
    "hbm_gb": lambda v: f"parallel.hbm_gb={v}",
    "compute_dtype": lambda v: f"model.overrides.compute_dtype={v}",
    "param_dtype": lambda v: f"model.overrides.param_dtype={v}",
    "capacity_factor": lambda v: f"model.overrides.capacity_factor={v}",
    "flash_attention": lambda v: "model.overrides.use_flash_attention=true",
}
# plan flags a recipe already answers: refused with the --set that changes the recipe instead
_REFUSED_WITH_RECIPE = {
    "model": "the recipe's model.source is used (--set model.source=...)",
    "npus": "the world size is the recipe's dp x tp x pp (--dp/--tp/--pp, or --set parallel.dp=...)",
    "seq_len": "the recipe's data.seq_len is used (--set data.seq_len=N)",
    "global_batch": "the global batch is train.micro_batch_size x grad_accum_steps (or micro_batches) x dp "
    "(--set train.grad_accum_steps=N)",
    "micro_batch_size": "the recipe's train.micro_batch_size is used (--set train.micro_batch_size=N)",
    "top": "only when searching layouts (--model/--npus without --dp/--tp/--pp/--ep)",
}


def _recipe_overrides(args) -> List[str]:
    """The --set strings the plan flags given with --recipe stand for (refusing those it answers)."""
    for key, why in _REFUSED_WITH_RECIPE.items():
        if getattr(args, key) is not None:
            raise UserError(f"--{key.replace('_', '-')}: not with --recipe; {why}")
    sets = []
    for key, to_set in _AS_SET.items():
        value = getattr(args, key)
        if value is not None and value is not False:
            sets.append(to_set(value))
    return sets


def _check_recipe(args, hw):
    import dataclasses

    from ms_deepseek.config.recipe import load_recipe, planning_config_path
    from ms_deepseek.parallel_plan.planner import check_recipe_fits, recipe_workload

    flag_sets = _recipe_overrides(args)
    as_written = load_recipe(args.recipe, args.overrides, planning_config_path(args.recipe))
    recipe = load_recipe(args.recipe, list(args.overrides) + flag_sets, planning_config_path(args.recipe))
    recipe.parallel = _recipe_layout(args, recipe)
    hw.hbm_gb = recipe.parallel.hbm_gb
    workload = recipe_workload(recipe)
    lora = _lora(args, getattr(recipe, "lora", None))
    workload = dataclasses.replace(workload, lora=lora, quant=_quant(args, getattr(recipe, "quant", None), lora))
    note = None
    before = recipe_workload(as_written).global_batch_size
    if before != workload.global_batch_size:
        changed = [
            f"--{k.replace('_', '-')} {getattr(args, k)}"
            for k in ("dp", "pp", "micro_batches")
            if getattr(args, k) is not None
        ]
        par, mbs = recipe.parallel, workload.micro_batch_size
        per_replica, rest = divmod(before, par.dp * mbs)
        keep = (
            ""
            if rest
            else f"; {before} needs --micro-batches {per_replica}"
            if par.pp > 1
            else f"; {before} needs --set train.grad_accum_steps={per_replica}"
        )
        note = (
            f"note: {' '.join(changed) or 'the overrides'} change{'s' if len(changed) == 1 else ''} the "
            f"recipe's global batch from {before} to {workload.global_batch_size} sequences per step "
            f"(dp x train.micro_batch_size x {'parallel.micro_batches' if par.pp > 1 else 'train.grad_accum_steps'})"
            f"{keep}"
        )
    # The precision flags are planner assumptions (no recipe key holds them); the dtypes come from the recipe.
    result = check_recipe_fits(recipe, hardware=hw, precision=_precision(args, recipe.model_config), workload=workload)
    return result, recipe, note


def _recipe_layout(args, recipe):
    """The recipe's layout with --dp/--tp/--pp/--ep/--micro-batches replacing its degrees (validated)."""
    from ms_deepseek.parallel_plan.validate import validate_layout

    par = resolve_layout(args, recipe.parallel)
    if args.stage_layers:  # after --pp (a --set would be checked against the recipe's pp)
        par = dataclasses.replace(par, stage_layers=_stage_layers(args.stage_layers))
    if par is not recipe.parallel:
        validate_layout(par, recipe.model_config, seq_len=recipe.seq_len)
    return par


def _compile(args, hw) -> int:
    """MindSpore's dry run compiles the recipe's graphs for the selected ranks (diagnostics.compile_check)."""
    from ms_deepseek.core.runtime import check_mindspore_version
    from ms_deepseek.diagnostics import compile_check as cc

    check_mindspore_version()
    micro_batches, args.micro_batches = args.micro_batches, None  # the compiled count, not the recipe's
    result, recipe, _ = _check_recipe(args, hw)
    _refuse_invalid(result)
    par = recipe.parallel
    reduction = cc.default_reduction(recipe, args.layers, micro_batches, moe_per_stage=2 if args.memory else 1)
    ranks = cc.parse_ranks(args.ranks, par.world_size, cc.default_ranks(par.dp, par.tp, par.pp))
    cann = args.cann or os.environ.get("ASCEND_HOME_PATH")
    if args.keep:
        keep = Path(args.keep)
        if keep.exists() and not keep.is_dir():
            raise UserError(f"--keep: {keep} exists and is not a folder")
    say = (lambda msg: None) if args.json else (lambda msg: print(msg, file=sys.stderr, flush=True))
    if not cann:
        from ms_deepseek.diagnostics.cann_stubs import cache_key, cache_root

        if not (cache_root() / cache_key(level=1 if args.memory else 0) / "MANIFEST").is_file():
            say(f"no CANN on this host: building stub CANN libraries for this MindSpore into {cache_root()} (once)")
    if args.memory:
        return _memory(args, hw, result, recipe, reduction, ranks, cann, say)
    report = cc.compile_recipe(
        args.recipe,
        recipe,
        list(args.overrides) + _recipe_overrides(args),
        ranks,
        reduction,
        cann=cann,
        work=Path(args.keep) if args.keep else None,
        eval_graph=not args.no_eval,
        progress=say,
    )
    reduced = _reduced_plan(args, hw, reduction)
    report.price_traffic(reduced.stage_comm_gb)
    if args.json:
        out = report.to_dict()
        out["planner"] = result.to_dict()
        out["planner_reduced"] = reduced.to_dict()
        print(json.dumps(out, indent=2))
    else:
        print(cc.format_report(report))
    return 0 if report.ok else 1


def _reduced_plan(args, hw, reduction):
    """The planner's result for the reduced model a compile ran (its depth, stage cut and micro-batches)."""
    saved = list(args.overrides)
    try:
        args.overrides = saved + reduction.overrides()
        reduced, _, _ = _check_recipe(args, hw)
    finally:
        args.overrides = saved
    return reduced


def _execute(args, hw) -> int:
    """``--execute``: every rank's compiled program of the reduced recipe run on CPU against one device."""
    from ms_deepseek.core.runtime import check_mindspore_version
    from ms_deepseek.diagnostics import execute_check as ec

    check_mindspore_version()
    result, recipe, _ = _check_recipe(args, hw)
    _refuse_invalid(result)
    keep = Path(args.keep) if args.keep else None
    if keep is not None and keep.exists() and not keep.is_dir():
        raise UserError(f"--keep: {keep} exists and is not a folder")
    say = (lambda msg: None) if args.json else (lambda msg: print(msg, file=sys.stderr, flush=True))
    report = ec.execute_recipe(
        args.recipe,
        recipe,
        list(args.overrides) + _recipe_overrides(args),
        steps=args.steps or 2,
        cann=args.cann or os.environ.get("ASCEND_HOME_PATH"),
        work=keep,
        progress=say,
    )
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(ec.format_report(report))
    return 0 if report.ok else 1


def _memory(args, hw, result, recipe, reduction, ranks, cann, say) -> int:
    """``--compile --memory``: each rank at two depths under MindSpore's level-1 dry run, beside the planner."""
    import dataclasses

    from ms_deepseek.diagnostics import compile_check as cc
    from ms_deepseek.diagnostics import memory_check as mc
    from ms_deepseek.parallel_plan.plan import stage_layer_counts
    from ms_deepseek.parallel_plan.ranks import stage_of_rank

    par = recipe.parallel
    step = max(1, par.pp)  # one more layer per pipeline stage (an MoE layer each: Reduction.stage_layers)
    depths = [reduction.layers] + (
        [reduction.layers + step] if reduction.layers + step <= reduction.full_layers else []
    )
    keep = Path(args.keep) if args.keep else None
    saved = list(args.overrides)
    out = {
        "recipe": args.recipe,
        "world_size": par.world_size,
        "layout": par.describe(),
        "depths": [],
        "micro_batches": reduction.micro_batches,
        "micro_batches_kind": reduction.what,
        "full_micro_batches": reduction.full_micro_batches,
        "full_layers": reduction.full_layers,
        "tolerance": args.tolerance,
    }
    lines = [
        f"memory {args.recipe}: {par.describe()}, world {par.world_size}; MindSpore's dry run at level 1 "
        "(MS_SIMULATION_LEVEL=1: the step runs once without kernels; nothing is saved)"
    ]
    ok, points = True, {}
    for layers in depths:
        red = dataclasses.replace(reduction, layers=layers)
        reduced = _reduced_plan(args, hw, red)  # the planner on the same reduced model
        report = cc.compile_recipe(
            args.recipe,
            recipe,
            list(saved) + _recipe_overrides(args),
            ranks,
            red,
            cann=cann,
            work=keep / f"layers_{layers}" if keep else None,
            eval_graph=False,
            progress=say,
            memory=True,
        )
        lines.append(f"  {red.describe()} ({report.provider})")
        entry = {"layers": layers, "stage_layers": red.stage_layers, "ranks": []}
        for r in report.ranks:
            step_graph = r.graphs.get("step", {})
            acct = step_graph.get("memory")
            if not r.ok or not acct or acct.get("error"):
                ok = False
                failed = next((g for g in r.graphs.values() if not g.get("ok")), {})
                why = (acct or {}).get("error") or failed.get("error", "no accounting")
                lines.append(f"  rank {r.rank}: FAILED: {why}" + (f"\n      log: {r.log}" if r.log else ""))
                entry["ranks"].append({"rank": r.rank, "ok": False, "error": why, "log": r.log})
                continue
            stage = stage_of_rank(r.rank, par)
            comp = mc.compare(reduced.stages[stage], acct, r.rank, layers)
            within = abs(comp.ratio - 1.0) <= args.tolerance
            ok = ok and within
            # x: the layers of the rank's own stage, the quantity the memory grows with
            on_stage = stage_layer_counts(layers, par.pp, red.stage_layers)[stage]
            points.setdefault(r.rank, []).append((on_stage, comp.planner_total, comp.ms_total))
            lines.append(
                f"  rank {r.rank} (stage {stage}), {layers} layers: step ran in {step_graph.get('seconds', 0):.0f} s"
                f", peak host memory {r.peak_rss_mb / 1024:.1f} GB"
            )
            lines += mc.format_comparison(comp)
            lines.append("    " + ("within" if within else "OUTSIDE") + f" the tolerance {args.tolerance:.0%}")
            big = ", ".join(
                f"{b['name']} x{b['blocks']} {b['mb'] / 1024:.2f}G ({b['category']})"
                for b in acct.get("largest_at_peak", [])[:6]
            )
            lines.append(f"    largest at MindSpore's peak: {big}")
            entry["ranks"].append(
                {
                    "rank": r.rank,
                    "stage": stage,
                    "ok": True,
                    "within_tolerance": within,
                    "planner_gb": round(comp.planner_total, 3),
                    "mindspore_gb": round(comp.ms_total, 3),
                    "mindspore_with_fragments_gb": round(comp.ms_actual, 3),
                    "ratio": round(comp.ratio, 3),
                    "planner_margin_gb": round(comp.margin, 3),
                    "rows": [
                        {"row": n, "planner_gb": round(p, 3), "mindspore_gb": round(m, 3)} for n, p, m in comp.rows
                    ],
                    "accounting": acct,
                    "log": r.log,
                }
            )
        out["depths"].append(entry)
    out["extrapolated"] = []
    full = reduction.full_layers
    full_counts = stage_layer_counts(full, par.pp, par.stage_layers)  # the recipe's own cut
    for rank, pts in sorted(points.items()):
        stage = stage_of_rank(rank, par)
        target = full_counts[stage]
        ms_fit = mc.extrapolate([(x, m) for x, _, m in pts], target)
        pl_fit = mc.extrapolate([(x, p) for x, p, _ in pts], target)
        if ms_fit is None:
            lines.append(f"  rank {rank}: one depth only: no extrapolation to {full} layers")
            continue
        where = f"{full} layers" + (f", {target} on stage {stage}" if par.pp > 1 else "")
        lines.append(
            f"  rank {rank}, extrapolated to {where} ({reduction.micro_batches} "
            f"{'micro-batches' if reduction.what == 'micro_batches' else 'accumulation steps'}): "
            f"MindSpore {ms_fit[0]:.1f} GB ({ms_fit[1]:+.2f} GB per layer), planner {pl_fit[0]:.1f} GB "
            f"({pl_fit[1]:+.2f} GB per layer); the planner for the recipe as written: "
            f"{result.stages[stage].total / mc.GB:.1f} GB of {result.usable_gb:.1f} GB usable"
        )
        out["extrapolated"].append(
            {
                "rank": rank,
                "layers": full,
                "stage_layers": target,
                "mindspore_gb": round(ms_fit[0], 2),
                "mindspore_gb_per_layer": round(ms_fit[1], 3),
                "planner_gb": round(pl_fit[0], 2),
                "planner_gb_per_layer": round(pl_fit[1], 3),
                "planner_recipe_gb": round(result.stages[stage].total / mc.GB, 2),
            }
        )
    out["ok"] = ok
    lines.append(
        "planner and MindSpore agree within the tolerance"
        if ok
        else "planner and MindSpore disagree (or a rank failed): see above"
    )
    lines.append(
        "  (MindSpore's level 1 does not count kernel workspaces, HCCL buffers or the runtime's reserve: "
        "the planner's margin)"
    )
    print(json.dumps(out, indent=2) if args.json else "\n".join(lines))
    return 0 if ok else 1


def _simulate(args, recipe, result) -> int:
    """The planner's verdict, then the simulation's lines; the exit status is the simulation's."""
    from ms_deepseek.diagnostics.simulate import all_passed, format_results, simulate

    if not args.json:
        _emit(args, result, None)
    results = simulate(recipe.model_config, recipe.parallel, recipe.seq_len, recipe.train.micro_batch_size)
    if args.json:
        out = result.to_dict()
        out["simulation"] = [
            {"check": r.name, "status": r.status, "max_err": r.max_err, "detail": r.detail} for r in results
        ]
        out["simulation_passed"] = all_passed(results)
        print(json.dumps(out, indent=2))
    else:
        print(format_results(results))
    return 0 if all_passed(results) else 1


def _emit(args, result, ranked: Optional[List]) -> None:
    if args.json:
        out = result.to_dict()
        if ranked is not None:
            out["ranked"] = [r.to_dict() for r in ranked]
        print(json.dumps(out, indent=2))
        return
    print(format_result(result))
    if ranked is not None and len(ranked) > 1:
        print("\nother layouts:")
        for r in ranked[1:]:
            verdict = "fits" if r.fits else "does not fit"
            lo, hi = r.tokens_per_s_range
            print(f"  {r.layout.describe():<58} {r.peak_gb:6.1f} GB  {lo:7.0f}-{hi:.0f} tokens/s/NPU  {verdict}")


def format_result(result) -> str:
    lines = [
        f"layout: {result.layout.describe()}  (world {result.layout.world_size}, "
        f"global batch {result.workload.global_batch_size} sequences, "
        f"grad accumulation {result.grad_accumulation})"
    ]
    if result.problems:
        lines.append("INVALID:")
        lines += [f"  {p}" for p in result.problems]
        return "\n".join(lines)
    verdict = "FITS" if result.fits else "DOES NOT FIT"
    lines.append(
        f"{verdict}: {result.peak_gb:.1f} GB per NPU (stage {result.worst.stage}) of {result.usable_gb:.1f} GB usable"
    )
    mem = result.memory_gb
    quant = result.workload.quant
    keys = (
        "weights",
        "weight_copies",
        "gradients",
        "optimizer",
        "activations",
        "working_set",
        "comm_buffers",
        "hccl_buffers",
        "workspace",
    )
    if quant is not None:
        group = (
            "one scale per output channel" if quant.group_size is None else f"one scale per {quant.group_size} inputs"
        )
        lines.append(
            f"quantized base: int{quant.bits}, {group} (weights below hold the quantized base; float32 "
            "scales and offsets, one weight dequantised to float32 at a time)"
        )
        keys += ("scales", "dequant_workspace")
    for key in keys:
        lines.append(f"  {key:<18}{mem[key]:9.2f} GB")
    if "eval_total" in mem:
        lines.append(
            f"  {'validation':<18}{mem['eval_total']:9.2f} GB at the eval graph's peak "
            f"(the training step: {mem['total']:.2f} GB)"
        )
    if result.eval_note:
        lines.append(f"  ({result.eval_note})")
    comm = result.comm_gb
    line = "traffic per NPU per step: " + ", ".join(f"{k} {v:.1f} GB" for k, v in comm.items())
    needed = sum(result.comm_minimum_gb.values())
    if needed > 0 and sum(comm.values()) > 1.0005 * needed:
        line += (
            f" ({sum(comm.values()) / needed:.3f} x the layout's minimum: a frozen embedding's gradient anchors "
            "MindSpore's accumulation pass)"
        )
    lines.append(line)
    t = result.time_s
    lo, hi = result.tokens_per_s_range
    sec = lambda x: f"{x:.1f}" if x >= 10 else f"{x:.3g}"  # noqa: E731
    lines.append(
        f"step {sec(t['step_high'])}-{sec(t['step'])} s (bubble {result.bubble_fraction:.1%}; at the low "
        f"end: pipeline {sec(t['pipeline'])} s, dp sync {sec(t['dp_sync'])} s)"
    )
    lines.append(
        f"throughput {lo:.0f}-{hi:.0f} tokens/s per NPU (MFU {result.mfu_range[0]:.1%}-"
        f"{result.mfu_range[1]:.1%}; low = MindFormers-calibrated efficiency, high = the DeepSeek "
        f"paper's, docs/planner.md)"
    )
    return "\n".join(lines)
