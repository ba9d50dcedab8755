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
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from builders import ATLAS_RECIPES

# MindSpore's graph compile runs on one core: two recipes at once take about half the wall time on the
# CI's two cores (the largest compile here peaks near 3 GB of host memory).
PARALLEL_COMPILES = 2


def _last_stage_first_rank(recipe) -> int:
    import yaml

    par = yaml.safe_load(recipe.read_text())["parallel"]
    return (par.get("pp", 1) - 1) * par.get("dp", 1) * par.get("tp", 1)


def _compile(recipe):
    """(exit code, stdout, stderr) of ``ms-deepseek plan --recipe R --compile --ranks <last stage> --json``."""
    argv = ["plan", "--recipe", str(recipe), "--compile", "--ranks", str(_last_stage_first_rank(recipe)), "--json"]
    proc = subprocess.run(
        [sys.executable, "-m", "ms_deepseek.cli", *argv], capture_output=True, text=True, timeout=1800
    )
    return proc.returncode, proc.stdout, proc.stderr


@pytest.fixture(scope="module")
def compiled():
    """Every recipe's compile, two at a time; the stub CANN libraries are built first, once (not by two at once)."""
    from ms_deepseek.diagnostics.cann_stubs import ensure_stubs

    ensure_stubs()
    with ThreadPoolExecutor(PARALLEL_COMPILES) as pool:
        return dict(zip(ATLAS_RECIPES, pool.map(_compile, ATLAS_RECIPES)))


@pytest.mark.parametrize("recipe", [pytest.param(p, id=p.stem) for p in ATLAS_RECIPES])
def test_recipe_compiles_and_matches_the_plan(recipe, compiled):
    code, out, err = compiled[recipe]
    assert out.strip(), err[-3000:]
    report = json.loads(out)
    graphs = report["ranks"][0]["graphs"]
    assert code == 0 and report["compiled"], json.dumps(graphs, indent=1)[:3000]
    assert set(graphs) == {"train", "eval"}
    train = graphs["train"]
    if report["world_size"] > 1:  # a sharded layout: MindSpore's layouts and strategies against the plan
        assert train["layouts_compared"] > 0 and train["strategies_compared"] > 0, train
    assert report["layers"] < report["full_layers"]  # the command chose a depth for this host and said so
