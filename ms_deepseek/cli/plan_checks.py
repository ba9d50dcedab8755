"""``ms-deepseek plan --recipe R`` with ``--compile``, ``--compile --memory`` or ``--execute``: MindSpore's
compiler, its level-1 dry run and the CPU execution of the recipe's ranks, beside the planner's figures."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

from ms_deepseek.cli.plan_recipe import check_recipe, read_recipe, refuse_invalid
from ms_deepseek.cli.plan_request import PlanRequest
from ms_deepseek.core.errors import UserError
from ms_deepseek.core.progress import progress_line


def _keep_dir(req: PlanRequest):
    """``--keep DIR`` as a path (None without it); refused when it names something other than a folder."""
    keep = Path(req.keep) if req.keep else None
    if keep is not None and keep.exists() and not keep.is_dir():
        raise UserError(f"--keep: {keep} exists and is not a folder")
    return keep


def _progress(req: PlanRequest):
    """The stream progress lines go to: stderr, none with --json."""
    return None if req.json else sys.stderr


def run_compile(req: PlanRequest, hw) -> int:
    """MindSpore's dry run compiles the recipe's graphs for the selected ranks (verification.compile.check)."""
    from ms_deepseek.core.runtime import check_mindspore_version
    from ms_deepseek.verification import dryrun
    from ms_deepseek.verification.compile import check as cc

    check_mindspore_version()
    micro_batches = req.micro_batches
    req = dataclasses.replace(req, micro_batches=None)  # --micro-batches is the compiled count, not the recipe's
    written = read_recipe(req)
    result, recipe, _ = check_recipe(req, hw, written)
    refuse_invalid(result)
    par = recipe.parallel
    reduction = dryrun.default_reduction(recipe, req.layers, micro_batches, moe_per_stage=2 if req.memory else 1)
    ranks = cc.parse_ranks(req.ranks, par.world_size, cc.default_ranks(par.dp, par.tp, par.pp))
    cann = req.cann or os.environ.get("ASCEND_HOME_PATH")
    keep = _keep_dir(req)
    progress = _progress(req)
    if not cann:
        from ms_deepseek.verification.cann_stubs import cache_key, cache_root

        if not (cache_root() / cache_key(level=1 if req.memory else 0) / "MANIFEST").is_file():
            progress_line(
                progress,
                f"no CANN on this host: building stub CANN libraries for this MindSpore into {cache_root()} (once)",
            )
    if req.memory:
        setup = cc.CompileSetup(cann=cann, work=keep, eval_graph=False, memory=True, progress=progress)
        return run_memory(req, hw, (written, result, recipe), reduction, ranks, setup)
    setup = cc.CompileSetup(cann=cann, work=keep, eval_graph=not req.no_eval, progress=progress)
    report = cc.compile_recipe(recipe, ranks, reduction, setup)
    reduced, _, _ = check_recipe(req, hw, written, reduction.overrides())  # the planner on the compiled model
    report.price_traffic(reduced.stage_comm_gb)
    if req.json:
        out = report.to_dict()
        out["planner"] = result.to_dict()
        out["planner_reduced"] = reduced.to_dict()
        print(json.dumps(out, indent=2))
    else:
        print(cc.format_report(report))
    return 0 if report.ok else 1


def run_execute(req: PlanRequest, hw) -> int:
    """``--execute``: every rank's compiled program of the reduced recipe run on CPU against one device."""
    from ms_deepseek.core.runtime import check_mindspore_version
    from ms_deepseek.verification.execute import check as ec

    check_mindspore_version()
    result, recipe, _ = check_recipe(req, hw, read_recipe(req))
    refuse_invalid(result)
    keep = _keep_dir(req)
    progress = _progress(req)
    report = ec.execute_recipe(
        recipe,
        steps=req.steps or 2,
        cann=req.cann or os.environ.get("ASCEND_HOME_PATH"),
        work=keep,
        progress=progress,
    )
    if req.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(ec.format_report(report))
    return 0 if report.ok else 1


def run_memory(req: PlanRequest, hw, recipes, reduction, ranks, setup) -> int:
    """``--compile --memory``: each rank at two depths under MindSpore's level-1 dry run, beside the planner.
    ``recipes``: the recipe as read (:func:`read_recipe`), the planner's verdict on it and the recipe planned."""
    written, result, recipe = recipes
    par = recipe.parallel
    step = max(1, par.pp)  # one more layer per pipeline stage (an MoE layer each: Reduction.stage_layers)
    depths = [reduction.layers] + (
        [reduction.layers + step] if reduction.layers + step <= reduction.full_layers else []
    )
    out = {
        "recipe": req.recipe,
        "world_size": par.world_size,
        "layout": par.describe(),
        "depths": [],
        "micro_batches": reduction.micro_batches,
        "micro_batches_kind": reduction.what,
        "full_micro_batches": reduction.full_micro_batches,
        "full_layers": reduction.full_layers,
        "tolerance": req.tolerance,
    }
    lines = [
        f"memory {req.recipe}: {par.describe()}, world {par.world_size}; MindSpore's dry run at level 1 "
        "(MS_SIMULATION_LEVEL=1: the step runs once without kernels; nothing is saved)"
    ]
    ok, points = True, {}
    for layers in depths:
        entry, depth_ok = _memory_depth(
            req, hw, (written, recipe), dataclasses.replace(reduction, layers=layers), ranks, setup, lines, points
        )
        ok = ok and depth_ok
        out["depths"].append(entry)
    out["extrapolated"] = _extrapolate(result, reduction, par, points, lines)
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
    print(json.dumps(out, indent=2) if req.json else "\n".join(lines))
    return 0 if ok else 1


def _memory_depth(req: PlanRequest, hw, recipes, red, ranks, setup, lines, points):
    """One depth of ``--memory``: the selected ranks compiled and run at level 1 with ``red``'s layers, each beside
    the planner on the same reduced model; (the depth's JSON entry, whether every rank agreed). ``recipes``: the
    recipe as read and the recipe planned. Each rank's (layers on its stage, planner total, MindSpore total) is
    added to ``points``."""
    from ms_deepseek.verification.compile import check as cc

    written, recipe = recipes
    layers = red.layers
    reduced, _, _ = check_recipe(req, hw, written, red.overrides())  # the planner on the same reduced model
    work = setup.work / f"layers_{layers}" if setup.work else None
    report = cc.compile_recipe(recipe, ranks, red, dataclasses.replace(setup, work=work))
    lines.append(f"  {red.describe()} ({report.provider})")
    entry = {"layers": layers, "stage_layers": red.stage_layers, "ranks": []}
    ok = True
    for r in report.ranks:
        row, rank_ok = _memory_rank(req, r, red, reduced, recipe.parallel, lines, points)
        ok = ok and rank_ok
        entry["ranks"].append(row)
    return entry, ok


def _memory_rank(req: PlanRequest, r, red, reduced, par, lines, points):
    """One rank's level-1 accounting beside the planner's stage: (its JSON row, whether it is within
    --tolerance; False when the rank failed)."""
    from ms_deepseek.parallel_plan.plan import stage_layer_counts
    from ms_deepseek.parallel_plan.ranks import stage_of_rank
    from ms_deepseek.verification.compile import memory_accounting as mc

    layers = red.layers
    step_graph = r.graphs.get("step", {})
    acct = step_graph.get("memory")
    if not r.ok or not acct or acct.get("error"):
        failed = next((g for g in r.graphs.values() if not g.get("ok")), {})
        why = (acct or {}).get("error") or failed.get("error", "no accounting")
        lines.append(f"  rank {r.rank}: FAILED: {why}" + (f"\n      log: {r.log}" if r.log else ""))
        return {"rank": r.rank, "ok": False, "error": why, "log": r.log}, False
    stage = stage_of_rank(r.rank, par)
    comp = mc.compare(reduced.stages[stage], acct, r.rank, layers)
    within = abs(comp.ratio - 1.0) <= req.tolerance
    # x: the layers of the rank's own stage, the quantity the memory grows with
    on_stage = stage_layer_counts(layers, par.pp, red.stage_layers)[stage]
    points.setdefault(r.rank, []).append((on_stage, comp.planner_total, comp.ms_total))
    lines.append(
        f"  rank {r.rank} (stage {stage}), {layers} layers: step ran in {step_graph.get('seconds', 0):.0f} s"
        f", peak host memory {r.peak_rss_mb / 1024:.1f} GB"
    )
    lines += mc.format_comparison(comp)
    lines.append("    " + ("within" if within else "OUTSIDE") + f" the tolerance {req.tolerance:.0%}")
    big = ", ".join(
        f"{b['name']} x{b['blocks']} {b['mb'] / 1024:.2f}G ({b['category']})"
        for b in acct.get("largest_at_peak", [])[:6]
    )
    lines.append(f"    largest at MindSpore's peak: {big}")
    row = {
        "rank": r.rank,
        "stage": stage,
        "ok": True,
        "within_tolerance": within,
        "planner_gb": round(comp.planner_total, 3),
        "mindspore_gb": round(comp.ms_total, 3),
        "mindspore_with_fragments_gb": round(comp.ms_actual, 3),
        "ratio": round(comp.ratio, 3),
        "planner_margin_gb": round(comp.margin, 3),
        "rows": [{"row": n, "planner_gb": round(p, 3), "mindspore_gb": round(m, 3)} for n, p, m in comp.rows],
        "accounting": acct,
        "log": r.log,
    }
    return row, within


def _extrapolate(result, reduction, par, points, lines):
    """Each rank's MindSpore and planner totals fitted over its stage's layers and extrapolated to the recipe's
    depth and cut, beside the planner for the recipe as written; the JSON rows."""
    from ms_deepseek.parallel_plan.plan import stage_layer_counts
    from ms_deepseek.parallel_plan.ranks import stage_of_rank
    from ms_deepseek.verification.compile import memory_accounting as mc

    extrapolated = []
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
        extrapolated.append(
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
    return extrapolated
