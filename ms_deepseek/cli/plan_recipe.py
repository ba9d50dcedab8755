"""``ms-deepseek plan``'s inputs: the precision, LoRA and quantization flags, and a recipe read with the
plan flags that stand for its keys (refusing those it answers), checked by the planner."""

from __future__ import annotations

import dataclasses
from typing import List, Sequence

from ms_deepseek.cli.args import resolve_layout
from ms_deepseek.cli.plan_request import PlanRequest
from ms_deepseek.core.errors import UserError


def precision(req: PlanRequest, cfg):
    from ms_deepseek.core.dtypes import itemsize
    from ms_deepseek.parallel_plan.workload import Precision

    return Precision(
        compute_bytes=itemsize(cfg.compute_dtype),
        grad_bytes=req.grad_bytes,
        optimizer_bytes=8 if req.optimizer_bytes is None else req.optimizer_bytes,
        master_bytes=req.master_bytes or 0,
        optimizer_level=req.optimizer_level or "level1",
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


def lora_workload(req: PlanRequest, section):
    """The LoRA workload from --lora-r / --lora-targets / --train-router over the recipe's section."""
    from ms_deepseek.config.lora import DEFAULT_TARGETS, LORA_TARGETS, LoraSpec

    if req.lora_r is None and req.lora_targets is None and section is None:
        if req.train_router:
            raise UserError("--train-router: only with LoRA (--lora-r or a recipe lora: section)")
        return None
    r = req.lora_r if req.lora_r is not None else (section.r if section is not None else None)
    if r is None:
        raise UserError("--lora-targets: needs --lora-r (the adapter rank)")
    if r < 1:
        raise UserError(f"--lora-r: must be >= 1, got {r}")
    if req.lora_targets is not None:
        targets = tuple(t.strip() for t in req.lora_targets.split(",") if t.strip())
        for t in targets:
            if t.rsplit(".", 1)[-1] not in LORA_TARGETS:
                raise UserError(f"--lora-targets: unknown target module {t!r}; known: {', '.join(LORA_TARGETS)}")
        if not targets:
            raise UserError("--lora-targets: empty")
    else:
        targets = tuple(section.target_modules) if section is not None else DEFAULT_TARGETS
    train_router = req.train_router or bool(section is not None and section.train_router)
    # the section's dropout sizes activations too (activations.lora_dropout_bytes); --lora-r alone: none
    dropout = section.dropout if section is not None else 0.0
    return LoraSpec(r=int(r), dropout=dropout, target_modules=list(targets), train_router=train_router)


def quant_workload(req: PlanRequest, section, lora):
    """The quantized base from --quant-bits / --quant-group-size over the recipe's ``quant:`` section."""
    from ms_deepseek.config.quant import QuantSpec

    if req.quant_bits is None and req.quant_group_size is None:
        return section
    bits = req.quant_bits if req.quant_bits is not None else (section.bits if section is not None else None)
    if bits is None:
        raise UserError("--quant-group-size: needs --quant-bits (4 or 8)")
    if lora is None:
        raise UserError("--quant-bits: only with LoRA (--lora-r or a recipe lora: section): a quantized base is frozen")
    group = req.quant_group_size
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


def _refuse_answered(req: PlanRequest) -> None:
    """The plan flags a recipe already answers are refused with --recipe."""
    for key, why in _REFUSED_WITH_RECIPE.items():
        if getattr(req, key) is not None:
            raise UserError(f"--{key.replace('_', '-')}: not with --recipe; {why}")


def recipe_overrides(req: PlanRequest) -> List[str]:
    """The --set strings the plan flags given with --recipe stand for (refusing those it answers)."""
    _refuse_answered(req)
    sets = []
    for key, to_set in _AS_SET.items():
        value = getattr(req, key)
        if value is not None and value is not False:
            sets.append(to_set(value))
    return sets


def read_recipe(req: PlanRequest):
    """The recipe file with the command line's --set, read once per command (the flags it answers refused first);
    every variant the command plans or compiles is built from it (``Recipe.with_overrides``)."""
    from ms_deepseek.config.recipe import load_recipe, planning_config_path

    _refuse_answered(req)
    return load_recipe(req.recipe, req.overrides, planning_config_path(req.recipe))


def check_recipe(req: PlanRequest, hw, written, extra: Sequence[str] = ()):
    """The planner's verdict on ``written`` (:func:`read_recipe`) with ``extra`` overrides (a compile's reduction)
    and the plan flags that stand for recipe keys or replace its degrees: (result, the recipe planned, a note
    when the flags change the global batch)."""
    from ms_deepseek.parallel_plan.planner import check_recipe_fits, recipe_workload

    flag_sets = recipe_overrides(req)
    as_written = written.with_overrides(extra) if extra else written
    recipe = written.with_overrides(list(extra) + flag_sets)
    recipe.parallel = _recipe_layout(req, recipe)
    hw.hbm_gb = recipe.parallel.hbm_gb
    workload = recipe_workload(recipe)
    lora = lora_workload(req, getattr(recipe, "lora", None))
    workload = dataclasses.replace(workload, lora=lora, quant=quant_workload(req, getattr(recipe, "quant", None), lora))
    note = None
    before = recipe_workload(as_written).global_batch_size
    if before != workload.global_batch_size:
        changed = [
            f"--{k.replace('_', '-')} {getattr(req, k)}"
            for k in ("dp", "pp", "micro_batches")
            if getattr(req, k) is not None
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
    result = check_recipe_fits(recipe, hardware=hw, precision=precision(req, recipe.model_config), workload=workload)
    return result, recipe, note


def _recipe_layout(req: PlanRequest, recipe):
    """The recipe's layout with --dp/--tp/--pp/--ep/--micro-batches replacing its degrees (validated)."""
    from ms_deepseek.parallel_plan.validate import validate_layout

    par = resolve_layout(req, recipe.parallel)
    if req.stage_layers:  # after --pp (a --set would be checked against the recipe's pp)
        par = dataclasses.replace(par, stage_layers=parse_stage_layers(req.stage_layers))
    if par is not recipe.parallel:
        validate_layout(par, recipe.model_config, seq_len=recipe.seq_len)
    return par
