"""Recipe loading and validation, and the learning-rate schedules (exact values)."""

import math
from pathlib import Path

import pytest
import yaml

from ms_deepseek.config.recipe import load_recipe, load_recipe_dict
from ms_deepseek.core.errors import UserError
from ms_deepseek.train.preflight import check_recipe, load_checked_recipe
from ms_deepseek.train.schedules import lr_at, milestone_steps

from repo_paths import REPO

SMALL = {
    "vocab_size": 512,
    "hidden_size": 32,
    "intermediate_size": 64,
    "moe_intermediate_size": 16,
    "num_hidden_layers": 2,
    "max_position_embeddings": 64,
}


def base(**sections):
    data = {
        "model": {"source": "tiny", "overrides": dict(SMALL)},
        "data": {"seq_len": 32, "embedded_vocab_size": 512},
        "train": {"steps": 10},
    }
    for key, value in sections.items():
        data.setdefault(key, {}).update(value)
    return data


def write(tmp_path, data, name="r.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


def test_shipped_recipe_loads_and_fits_the_tiny_preset():
    recipe = load_recipe(REPO / "recipes" / "tiny-cpu.yaml")
    assert recipe.model_config.vocab_size == 4096
    assert recipe.seq_len == 256
    assert recipe.model_config.capacity_factor == 2.0
    assert recipe.model_config.device_aux_loss_alpha == 0.05
    assert recipe.global_batch_size == recipe.train.micro_batch_size


def test_overrides_reach_every_section(tmp_path):
    path = write(tmp_path, base())
    recipe = load_recipe(
        path,
        [
            "train.steps=7",
            "optim.lr=3e-4",
            "model.overrides.capacity_factor=1.5",
            "parallel.dp=2",
            "train.grad_accum_steps=3",
            "model.comm_aux_loss_alpha=0.02",
        ],
    )
    assert recipe.train.steps == 7
    assert recipe.optim.lr == pytest.approx(3e-4)
    assert recipe.model_config.capacity_factor == 1.5
    assert recipe.model_config.comm_aux_loss_alpha == 0.02
    assert recipe.global_batch_size == recipe.train.micro_batch_size * 3 * 2
    # round trip: the saved recipe loads back to the same values
    again = load_recipe_dict(yaml.safe_load(recipe.to_yaml()))
    assert again.to_dict() == recipe.to_dict()


def test_model_source_can_be_a_config_json(tmp_path):
    from ms_deepseek.config.model import get_preset

    get_preset("tiny", **SMALL).save(tmp_path / "config.json")
    recipe = load_recipe_dict(base(model={"source": str(tmp_path / "config.json"), "overrides": {}}))
    assert recipe.model_config.hidden_size == 32
    assert recipe.weights_folder is None  # a config alone: random init
    (tmp_path / "model.safetensors").write_bytes(b"")
    recipe = load_recipe_dict(base(model={"source": str(tmp_path), "overrides": {}}))
    assert recipe.weights_folder == tmp_path


@pytest.mark.parametrize(
    "sections, key",
    [
        ({"trian": {}}, "trian"),
        ({"train": {"stepz": 3}}, "train.stepz"),
        ({"train": {"steps": "many"}}, "train.steps"),
        ({"train": {"steps": 0}}, "train.steps"),
        ({"train": {"grad_accum_steps": 0}}, "train.grad_accum_steps"),
        ({"train": {"micro_batch_size": -1}}, "train.micro_batch_size"),
        ({"train": {"clip_grad_norm": 0}}, "train.clip_grad_norm"),
        ({"optim": {"lr": -1e-3}}, "optim.lr"),
        ({"optim": {"min_lr": 1.0}}, "optim.min_lr"),
        ({"optim": {"schedule": "linear"}}, "optim.schedule"),
        ({"optim": {"milestones": [0.9, 0.6]}}, "optim.milestones"),
        ({"optim": {"beta2": 1.0}}, "optim.beta2"),
        ({"optim": {"warmup_steps": -5}}, "optim.warmup_steps"),
        ({"data": {"seq_len": 4096}}, "data.seq_len"),
        ({"data": {"embedded_vocab_size": 1024}}, "data.embedded_vocab_size"),
        ({"data": {"tokenizer": "/nonexistent/tokenizer.model"}}, "data.tokenizer"),
        ({"data": {"path": "/nonexistent/prepared"}}, "data.path"),
        ({"model": {"source": "deepseek-v9"}}, "model.source"),
        ({"model": {"overrides": {"hidden_sise": 8}}}, "model.overrides.hidden_sise"),
        ({"model": {"overrides": {"capacity_factor": -1.0}}}, "capacity_factor"),
        ({"model": {"device_aux_loss_alpha": -0.1}}, "model.device_aux_loss_alpha"),
        ({"parallel": {"dp": 0}}, "parallel.dp"),
        ({"checkpoint": {"keep_last": 0}}, "checkpoint.keep_last"),
        ({"checkpoint": {"save_interval": -1}}, "checkpoint.save_interval"),
        ({"logging": {"log_interval": 0}}, "logging.log_interval"),
    ],
)
def test_bad_values_fail_at_load_naming_the_key(tmp_path, sections, key):
    """Schema errors (config.recipe) and what the run would not find on this machine (train.preflight)."""
    path = write(tmp_path, base(**sections))
    with pytest.raises(UserError) as err:
        load_checked_recipe(path)
    message = str(err.value)
    assert key in message, message
    assert "\n" not in message
    assert str(path) in message


def test_micro_batch_beyond_the_dispatch_sort_keys_is_refused_at_load():
    """3 x top-k x tokens per data-parallel rank must stay below 2**24 (the MoE dispatch's float32 keys)."""
    from ms_deepseek.config.dispatch_shapes import max_tokens_per_group

    k = load_recipe_dict(base()).model_config.num_experts_per_tok
    fits = max_tokens_per_group(k) // 32  # micro-batch rows of 32 tokens
    assert 3 * k * fits * 32 < 2**24 <= 3 * k * (fits + 1) * 32
    load_recipe_dict(base(train={"micro_batch_size": fits}))
    with pytest.raises(UserError) as err:
        load_recipe_dict(base(train={"micro_batch_size": fits + 1}))
    assert str(err.value).startswith(
        f"train.micro_batch_size: {fits + 1} x 32 = {(fits + 1) * 32} tokens per data-parallel rank exceed"
    ), err.value


def test_tokenizer_larger_than_the_model_vocabulary_is_refused(tmp_path):
    import argparse
    import dataclasses
    import os

    from ms_deepseek.data.tokenizer import train_sentencepiece

    text = [Path(m.__file__).read_text(encoding="utf-8") for m in (argparse, dataclasses, os)]
    train_sentencepiece(text, 600, tmp_path / "tokenizer.model")
    # within the model's vocabulary the tokenizer passes, and the next check runs: the data it would read, the
    # embedded default corpus, was prepared with another tokenizer
    within = load_recipe_dict(
        base(data={"tokenizer": str(tmp_path / "tokenizer.model")}, model={"overrides": dict(SMALL, vocab_size=1024)})
    )
    with pytest.raises(UserError, match=r"^data.tokenizer: .* is not the tokenizer .* was prepared with"):
        check_recipe(within)
    with pytest.raises(
        UserError,
        match=r"data.tokenizer: the tokenizer has \d+ tokens but the model's vocab_size "
        r"is 512",
    ):
        check_recipe(load_recipe_dict(base(data={"tokenizer": str(tmp_path / "tokenizer.model")})))


def test_bad_yaml_and_missing_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: {steps: 3\n")
    with pytest.raises(UserError, match="not valid YAML"):
        load_recipe(bad)
    with pytest.raises(UserError, match="no such recipe file"):
        load_recipe(tmp_path / "missing.yaml")
    with pytest.raises(UserError, match="--set 'train.steps': expected section.key=value"):
        load_recipe(write(tmp_path, base()), ["train.steps"])


# ------------------------------------------------------------------ schedules


def test_cosine_schedule_exact_values():
    kw = dict(schedule="cosine", lr=1e-3, total_steps=100, warmup_steps=10, min_lr=1e-4)
    assert lr_at(1, **kw) == pytest.approx(1e-4)  # warmup: lr * 1/10
    assert lr_at(5, **kw) == pytest.approx(5e-4)
    assert lr_at(10, **kw) == pytest.approx(1e-3)  # peak
    assert lr_at(55, **kw) == pytest.approx(1e-4 + 0.9e-3 * 0.5)  # half way through the cosine
    assert lr_at(100, **kw) == pytest.approx(1e-4)  # floor at the end
    assert lr_at(32, **kw) == pytest.approx(1e-4 + 0.9e-3 * 0.5 * (1 + math.cos(math.pi * 22 / 90)))


def test_step_schedule_exact_values():
    kw = dict(schedule="step", lr=2.4e-4, total_steps=1000, warmup_steps=100)
    assert milestone_steps(1000, (0.6, 0.9)) == [600, 900]
    assert lr_at(50, **kw) == pytest.approx(1.2e-4)
    assert lr_at(100, **kw) == pytest.approx(2.4e-4)
    assert lr_at(600, **kw) == pytest.approx(2.4e-4)  # decay applies after the milestone
    assert lr_at(601, **kw) == pytest.approx(2.4e-4 * 0.316)
    assert lr_at(900, **kw) == pytest.approx(2.4e-4 * 0.316)
    assert lr_at(901, **kw) == pytest.approx(2.4e-4 * 0.316**2)
    assert lr_at(1000, **kw) == pytest.approx(2.4e-4 * 0.316**2)


@pytest.mark.parametrize("schedule", ["cosine", "step", "constant"])
def test_schedule_cells_match_the_python_math(schedule):
    """The Cells the optimizer calls (graph mode) give the same lr as ``lr_at``, step by step."""
    import mindspore as ms

    from ms_deepseek.config.recipe import OptimSection
    from ms_deepseek.train import optim

    cfg = OptimSection(lr=1e-3, min_lr=1e-4, schedule=schedule, warmup_steps=4, milestones=[0.5, 0.75])
    cell = optim.build_lr_schedule(cfg, total_steps=20)
    ms.set_context(mode=ms.GRAPH_MODE)
    expected = optim.lr_fn(cfg, 20)
    for global_step in (0, 1, 3, 4, 9, 10, 11, 14, 15, 16, 19, 25):
        got = float(cell(ms.Tensor([global_step], ms.int32)).asnumpy().reshape(-1)[0])
        assert got == pytest.approx(expected(global_step + 1), rel=2e-6, abs=1e-12), (schedule, global_step)


def test_global_batch_is_one_definition_for_train_and_plan():
    """pp = 1 with micro_batches > 1: micro_batches means nothing without a pipeline, so `plan --recipe`
    sizes the same global batch `train` runs (it used to multiply micro_batches in)."""
    from ms_deepseek.parallel_plan.planner import recipe_workload
    from ms_deepseek.parallel_plan.validate import layout_problems

    flat = load_recipe_dict(
        base(train={"micro_batch_size": 8, "grad_accum_steps": 2}, parallel={"dp": 1, "micro_batches": 4})
    )
    assert flat.global_batch_size == 16 == recipe_workload(flat).global_batch_size
    assert layout_problems(flat.parallel, flat.model_config, global_batch_size=16, micro_batch_size=8) == []
    piped = load_recipe_dict(base(train={"micro_batch_size": 2}, parallel={"dp": 2, "pp": 2, "micro_batches": 4}))
    assert piped.global_batch_size == 16 == recipe_workload(piped).global_batch_size


def test_a_loaded_recipe_travels_as_data_and_its_variants_read_no_file(tmp_path, monkeypatch):
    """``Recipe.to_request`` / ``recipe_from_request`` and ``Recipe.with_overrides`` build from what the recipe was
    loaded from: the same recipe as a load of the file, with no file read; a variant naming another model.source
    reads that source."""
    import dataclasses
    import json

    from ms_deepseek.config import recipe as recipe_module

    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(base(parallel={"dp": 1})))
    loaded = load_recipe(path, ["train.steps=7"])
    want = load_recipe(path, ["train.steps=7", "model.overrides.num_hidden_layers=1"])

    def built(r):
        return {k: v for k, v in dataclasses.asdict(r).items() if k != "origin"}

    reads = []
    read = recipe_module.read_architecture
    monkeypatch.setattr(recipe_module, "read_architecture", lambda *a, **k: reads.append(a) or read(*a, **k))
    path.unlink()  # nothing below may read it
    copy = recipe_module.recipe_from_request(json.loads(json.dumps(loaded.to_request())))
    assert built(copy) == built(loaded)
    variant = loaded.with_overrides(["model.overrides.num_hidden_layers=1"])
    assert built(variant) == built(want) and variant.model_config.num_hidden_layers == 1
    assert reads == []
    # the origin is what a variant is built from, not the sections changed after loading
    loaded.train.steps = 99
    assert loaded.with_overrides([]).train.steps == 7
    other = loaded.with_overrides(["model.source=tiny", "model.overrides={}"])  # the same source: not read again
    assert reads == [] and other.model_config.num_hidden_layers != 1
    with pytest.raises(UserError, match=rf"^{path}: model.source: "):
        loaded.with_overrides([f"model.source={tmp_path / 'absent'}"])
    assert len(reads) == 1
