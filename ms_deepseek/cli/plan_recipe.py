"""``ms-deepseek plan``'s inputs: the precision, LoRA and quantization flags, and a recipe read with the
plan flags that stand for its keys (refusing those it answers), checked by the planner."""

from __future__ import annotations

import dataclasses
from typing import List

from ms_deepseek.cli.args import resolve_layout
from ms_deepseek.core.errors import UserError


def precision(args, cfg):
    from ms_deepseek.core.dtypes import itemsize
    from ms_deepseek.parallel_plan.workload import Precision

    return Precision(
        compute_bytes=itemsize(cfg.compute_dtype),
        grad_bytes=args.grad_bytes,
        optimizer_bytes=8 if args.optimizer_bytes is None else args.optimizer_bytes,
        master_bytes=args.master_bytes or 0,
        optimizer_level=args.optimizer_level or "level1",
    )


def parse_stage_layers(text: str) -> List[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise UserError(f"--stage-layers: expected comma-separated integers, got {text!r}") from None


def refuse_invalid(result) -> None:
    """An invalid layout is bad input (exit 2, on stderr), not an answer that does not fit."""
    if result.problems:
        raise UserError(f"invalid layout {result.layout.describe()}: " + "; ".join(result.problems))


def lora_workload(args, section):
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
    # the section's dropout sizes activations too (activations.lora_dropout_bytes); --lora-r alone: none
    dropout = section.dropout if section is not None else 0.0
    return LoraSpec(r=int(r), dropout=dropout, target_modules=list(targets), train_router=train_router)


def quant_workload(args, section, lora):
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


def recipe_overrides(args) -> List[str]:
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


def check_recipe(args, hw):
    import dataclasses

    from ms_deepseek.config.recipe import load_recipe, planning_config_path
    from ms_deepseek.parallel_plan.planner import check_recipe_fits, recipe_workload

    flag_sets = recipe_overrides(args)
    as_written = load_recipe(args.recipe, args.overrides, planning_config_path(args.recipe))
    recipe = load_recipe(args.recipe, list(args.overrides) + flag_sets, planning_config_path(args.recipe))
    recipe.parallel = _recipe_layout(args, recipe)
    hw.hbm_gb = recipe.parallel.hbm_gb
    workload = recipe_workload(recipe)
    lora = lora_workload(args, getattr(recipe, "lora", None))
    workload = dataclasses.replace(
        workload, lora=lora, quant=quant_workload(args, getattr(recipe, "quant", None), lora)
    )
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
    result = check_recipe_fits(recipe, hardware=hw, precision=precision(args, recipe.model_config), workload=workload)
    return result, recipe, note


def _recipe_layout(args, recipe):
    """The recipe's layout with --dp/--tp/--pp/--ep/--micro-batches replacing its degrees (validated)."""
    from ms_deepseek.parallel_plan.validate import validate_layout

    par = resolve_layout(args, recipe.parallel)
    if args.stage_layers:  # after --pp (a --set would be checked against the recipe's pp)
        par = dataclasses.replace(par, stage_layers=parse_stage_layers(args.stage_layers))
    if par is not recipe.parallel:
        validate_layout(par, recipe.model_config, seq_len=recipe.seq_len)
    return par
