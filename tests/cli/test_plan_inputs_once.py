"""``plan --recipe R --compile`` reads its inputs once: the recipe file and the architecture ``model.source`` names
are read by the command's first step, and every variant it plans or compiles (the layout flags, the reduced depth,
the planner on the reduced model) and the recipe each rank's worker builds (``recipe_from_request``) come from
that one reading. The workers are stand-ins that build their recipe from the request as the worker does."""

import json
from collections import Counter

import pytest

from ms_deepseek.cli import main
from ms_deepseek.config import recipe as recipe_module
from ms_deepseek.verification.compile import check as cc

from repo_paths import RECIPES

TINY = str(RECIPES / "tiny-cpu.yaml")


def _counted(monkeypatch, reads: Counter) -> None:
    """Count the recipe file's and model.source's readings (``load_recipe``, ``read_architecture``)."""
    load, arch = recipe_module.load_recipe, recipe_module.read_architecture

    def load_recipe(*a, **k):
        reads["recipe file"] += 1
        return load(*a, **k)

    def read_architecture(*a, **k):
        reads["architecture"] += 1
        return arch(*a, **k)

    monkeypatch.setattr(recipe_module, "load_recipe", load_recipe)
    monkeypatch.setattr(recipe_module, "read_architecture", read_architecture)


def _stand_in_workers(monkeypatch, built: list) -> None:
    """Each rank's worker: the recipe built from its request (verification.compile.worker.run), a compiled train graph."""

    def run_rank(job, rank):
        request = json.loads(json.dumps({"recipe": job.recipe}))  # what the worker reads from request.json
        built.append(recipe_module.recipe_from_request(request["recipe"]))
        return cc.RankResult(rank, stage=0, graphs={"train": {"ok": True}})

    monkeypatch.setattr(cc, "run_rank", run_rank)
    monkeypatch.setattr(cc, "compile_environment", lambda *a, **k: ({}, "stand-in"))


@pytest.mark.parametrize("flags", [[], ["--dp", "2", "--ep", "2", "--optimizer-shard"]], ids=["as-written", "flags"])
def test_plan_compile_reads_the_recipe_and_its_architecture_once(monkeypatch, capsys, flags):
    reads, built = Counter(), []
    _counted(monkeypatch, reads)
    _stand_in_workers(monkeypatch, built)
    code = main(["plan", "--recipe", TINY, *flags, "--compile", "--ranks", "0", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["compiled"], report
    assert reads == Counter({"recipe file": 1, "architecture": 1}), reads
    # the worker's recipe is the compiled variant: the command line's layout and the reduced depth
    (recipe,) = built
    assert recipe.parallel.world_size == report["world_size"] == (2 if flags else 1)
    assert recipe.parallel.optimizer_shard == bool(flags)
    assert recipe.model_config.num_hidden_layers == report["layers"]
