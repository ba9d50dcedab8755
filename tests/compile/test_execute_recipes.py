"""Every shipped Atlas recipe's sharded step, executed rank by rank on CPU, equals the step on one device:
``ms-deepseek plan --recipe R --execute`` (MindSpore compiles every rank of the recipe's reduced layout, the
executor runs the compiled programs with the collectives done between them, and each step's loss, gradient
norm, learning rate and every tensor of every rank are compared with the one-device run of the same reduced
model). Also layouts with every degree above 1, which no shipped recipe has."""

import json

import pytest

from builders import ATLAS_RECIPES, SMALL_MODEL, main_captured, write_recipe


def _assert_agrees(code, out):
    report = json.loads(out)
    assert code == 0 and report["agrees"], json.dumps(
        {k: v for k, v in report.items() if k != "communication_per_step"}, indent=1
    )
    assert report["compared"] > 0 and len(report["loss"]) == report["steps"] == 2
    for one_device, sharded in report["loss"]:
        assert abs(one_device - sharded) <= 1e-5 * abs(one_device)
    return report


@pytest.mark.parametrize("recipe", [pytest.param(p, id=p.stem) for p in ATLAS_RECIPES])
def test_recipe_executes_like_one_device(recipe):
    code, out, _ = main_captured(["plan", "--recipe", str(recipe), "--execute", "--json"])
    report = _assert_agrees(code, out)
    if report["world_size"] > 1:  # the ranks communicated, and the report says how much per group
        assert report["communication_per_step"], report


@pytest.mark.parametrize(
    "parallel",
    [
        pytest.param({"dp": 2, "tp": 2, "pp": 2, "ep": 2, "micro_batches": 3}, id="dp2-tp2-pp2-ep2"),
        pytest.param(
            {"dp": 2, "tp": 2, "pp": 2, "ep": 2, "micro_batches": 3, "optimizer_shard": True, "recompute": "full"},
            id="dp2-tp2-pp2-ep2-optshard-recompute",
        ),
        pytest.param(
            {
                "dp": 2,
                "tp": 2,
                "pp": 2,
                "ep": 2,
                "micro_batches": 3,
                "sequence_parallel": True,
                "optimizer_shard": True,
            },
            id="dp2-tp2-pp2-ep2-seqpar-optshard",
        ),
    ],
)
def test_every_degree_above_one_executes_like_one_device(tmp_path, parallel):
    model = dict(SMALL_MODEL, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=3)
    recipe = write_recipe(
        tmp_path,
        {
            "model": {"source": "deepseek-v2-lite", "overrides": model},
            "data": {"seq_len": 32, "embedded_vocab_size": 512},
            "train": {"steps": 3, "micro_batch_size": 1, "seed": 7},
            "optim": {"lr": 1e-3, "warmup_steps": 1},
            "parallel": parallel,
            "logging": {"tensorboard": False},
        },
    )
    code, out, _ = main_captured(["plan", "--recipe", str(recipe), "--execute", "--json"])
    _assert_agrees(code, out)
