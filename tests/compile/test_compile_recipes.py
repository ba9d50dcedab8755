"""Every shipped Atlas recipe, compiled by MindSpore itself: ``ms-deepseek plan --recipe R --compile``.

Full width, the command's default reduced depth and micro-batch count, the first rank of the last
pipeline stage (the one that computes the loss), train and validation graphs, no weights and no data
on the machine, stub CANN libraries. The layouts and strategies MindSpore compiled must match the plan.

Pipeline layouts compile in MindSpore's ``semi_auto`` mode (``parallel_apply.apply.search_mode``).
``v2-pretrain-256npu`` (pp 8, dp 32 at 236B width) compiles in under 3 GB since the flash-attention pad is
built at run time (model/mla.py): its folded zeros constant, [32, 128, 4096, 64] bfloat16 per layer and
micro-batch, took the host past 22 GB.
"""

import json

import pytest

from builders import ATLAS_RECIPES, main_captured
from lines import record
from repo_paths import RECIPES


@pytest.mark.smoke
def test_a_small_sharded_layout_compiles_and_matches_the_plan():
    """The default tier's compile: the tiny recipe on two ranks (dp 2, ep 2) with optimizer sharding, rank 0, train and
    validation graphs; MindSpore's layouts, strategies and traffic against the plan."""
    code, out, err = main_captured(
        ["plan", "--recipe", str(RECIPES / "tiny-cpu.yaml"), "--dp", "2", "--ep", "2", "--optimizer-shard"]
        + ["--compile", "--ranks", "0", "--json"]
    )
    report = json.loads(out)
    assert code == 0 and report["compiled"] and report["world_size"] == 2, err[-2000:]
    train = report["ranks"][0]["graphs"]["train"]
    assert train["layouts_compared"] > 0 and train["strategies_compared"] > 0, train
    rows = train["traffic_vs_planner"]
    assert rows and all(row["ok"] for row in rows), json.dumps(rows, indent=1)


# compiled on both MindSpore lines and compared (tests/helpers/lines.py): a pipeline layout
LINES = {"v2-lora-16npu"}


@pytest.mark.parametrize(
    "recipe",
    [pytest.param(p, id=p.stem, marks=[pytest.mark.lines] if p.stem in LINES else []) for p in ATLAS_RECIPES],
)
def test_recipe_compiles_and_matches_the_plan(recipe):
    import yaml

    par = yaml.safe_load(recipe.read_text())["parallel"]
    last_stage_first_rank = (par.get("pp", 1) - 1) * par.get("dp", 1) * par.get("tp", 1)
    code, out, err = main_captured(
        ["plan", "--recipe", str(recipe), "--compile", "--ranks", str(last_stage_first_rank), "--json"]
    )
    report = json.loads(out)
    graphs = report["ranks"][0]["graphs"]
    assert code == 0 and report["compiled"], json.dumps(graphs, indent=1)[:3000]
    assert set(graphs) == {"train", "eval"}
    train = graphs["train"]
    if report["world_size"] > 1:  # a sharded layout: MindSpore's layouts and strategies against the plan
        assert train["layouts_compared"] > 0 and train["strategies_compared"] > 0, train
    assert report["layers"] < report["full_layers"]  # the command chose a depth for this host and said so
    # the planner prices what MindSpore compiled: per layout axis, within traffic.TOLERANCE of the compiled step's
    # bytes for the same reduced model (the planner's tokens/s follows from these)
    rows = train.get("traffic_vs_planner", [])
    assert all(row["ok"] for row in rows), json.dumps(rows, indent=1)
    if report["world_size"] > 1:
        assert rows, train.get("traffic")
    kept = ("layouts_compared", "strategies_compared", "communication", "traffic_vs_planner", "global_norm_allreduce")
    if recipe.stem in LINES:  # the other line runs only these
        record(f"compile {recipe.stem}", {name: {k: g.get(k) for k in kept} for name, g in graphs.items()})
