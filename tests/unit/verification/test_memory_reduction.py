"""``plan --compile --memory``'s reduced pipeline and its extrapolation, MindSpore replaced by a stand-in.

The stand-in's peak grows by a fixed amount per layer of the rank's own stage, as a stage's memory does; the
command must put that line through the recipe's own cut. The reduced cut must give every stage an MoE layer
at both depths: with an even cut, stage 0 of a V2 pipeline held the dense layer alone at the first depth, and the
second depth added the stage's first MoE layer (its one-off buffers read as a per-layer cost).
"""

import dataclasses
import json
import types
from pathlib import Path

from ms_deepseek.cli import main
from ms_deepseek.config.recipe import load_recipe, planning_config_path
from ms_deepseek.parallel_plan.plan import layer_stages, stage_layer_counts
from ms_deepseek.parallel_plan.ranks import stage_of_rank
from ms_deepseek.verification import dryrun
from ms_deepseek.verification.compile import check as cc

ROOT = Path(__file__).resolve().parents[3]
P256 = str(ROOT / "recipes" / "v2-pretrain-256npu.yaml")
BASE_MB, PER_LAYER_MB = 3000.0, 700.0


def _recipe():
    return load_recipe(P256, (), planning_config_path(P256))


def _moe_on_every_stage(cfg, red) -> bool:
    stages = layer_stages(red.layers, red.pp, red.stage_layers)
    return all(any(cfg.is_moe_layer(i) for i, st in enumerate(stages) if st == s) for s in range(red.pp))


def test_every_stage_of_the_reduced_pipeline_holds_an_moe_layer_at_both_depths():
    recipe = _recipe()
    cfg, pp = recipe.model_config, recipe.parallel.pp
    red = dryrun.default_reduction(recipe)
    deeper = dataclasses.replace(red, layers=red.layers + pp)
    assert red.stage_layers == [2] + [1] * (pp - 1)  # layer 0 (dense) and one MoE layer on stage 0
    # one micro-batch more than the stages: stage 0 runs a forward after its first backward, as in the recipe's
    # steady state (with pp, its last forward came first and the forward-only blocks were gone at its backward)
    assert red.micro_batches == pp + 1
    assert [b - a for a, b in zip(red.stage_layers, deeper.stage_layers)] == [1] * pp  # one MoE layer more each
    assert _moe_on_every_stage(cfg, red) and _moe_on_every_stage(cfg, deeper)
    assert f"parallel.stage_layers=[{','.join(map(str, red.stage_layers))}]" in red.overrides()
    # the mistake the rule exists for: the dense layers not counted, stage 0 holds layer 0 alone
    assert not _moe_on_every_stage(cfg, dataclasses.replace(red, dense_layers=0))


def test_too_few_layers_for_an_moe_layer_per_stage_fall_back_to_the_even_cut():
    red = dryrun.default_reduction(_recipe(), layers=8)
    assert red.stage_layers is None and "parallel.stage_layers=null" in red.overrides()


def _stand_in(calls):
    """compile_recipe's stand-in: each rank's peak is BASE + PER_LAYER x the layers of its stage."""

    def compile_recipe(recipe, ranks, red, setup=None):
        calls.append(red)
        counts = stage_layer_counts(red.layers, recipe.parallel.pp, red.stage_layers)
        out = []
        for rank in ranks:
            peak = BASE_MB + PER_LAYER_MB * counts[stage_of_rank(rank, recipe.parallel)]
            acct = {
                "tracker_peak_mb": peak,
                "used_peak_mb": peak,
                "actual_peak_mb": peak,
                "at_peak_mb": {"activations": peak},
                "largest_at_peak": [],
            }
            out.append(cc.RankResult(rank=rank, stage=0, graphs={"step": {"ok": True, "memory": acct}}))
        return types.SimpleNamespace(ranks=out, provider="stand-in", ok=True)

    return compile_recipe


def test_the_extrapolation_runs_through_the_layers_of_the_ranks_stage_to_the_recipes_cut(monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(cc, "compile_recipe", _stand_in(calls))
    main(["plan", "--recipe", P256, "--compile", "--memory", "--ranks", "0,255", "--no-eval", "--json"])
    out = json.loads(capsys.readouterr().out)
    # two MoE layers per stage, then three: stage 0 (the dense layer and one MoE layer) peaked elsewhere than with
    # two or more (dryrun.default_reduction)
    assert [c.layers for c in calls] == [17, 25]
    assert [d["stage_layers"] for d in out["depths"]] == [[3] + [2] * 7, [4] + [3] * 7]
    full = stage_layer_counts(60, 8)  # the recipe's even cut: 7 layers on stage 0, 8 on stage 7
    got = {e["rank"]: e for e in out["extrapolated"]}
    for rank, stage in ((0, 0), (255, 7)):
        assert got[rank]["stage_layers"] == full[stage]
        expected = (BASE_MB + PER_LAYER_MB * full[stage]) / 1024
        assert abs(got[rank]["mindspore_gb"] - expected) < 0.01, (rank, got[rank], expected)
        assert abs(got[rank]["mindspore_gb_per_layer"] - PER_LAYER_MB / 1024) < 1e-3
