"""Training: metrics, exact resume, crash-safe checkpoints, accumulation, clipping, loss scale, bad data.

One tiny prepared corpus (seq 32, vocab 512) and a 2-layer model (hidden 32, one MoE
layer with 8 experts) are shared by the module; each ``train()`` call compiles its own
graphs (~10 s each on 2 cores), so the runs are few and reused across tests.
"""

import json
import math
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from ms_deepseek.cli import main
from ms_deepseek.core.errors import UserError

from builders import SMALL_MODEL, write_recipe
from tolerances import assert_close_to_scale

STEPS = 4


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    from ms_deepseek.data.prepare import prepare_embedded_default

    out = tmp_path_factory.mktemp("data") / "corpus"
    prepare_embedded_default(out, seq_len=32, vocab_size=512, max_bytes=150_000, progress=False)
    return out


def recipe_dict(data_dir, **sections):
    data = {
        "model": {
            "source": "tiny",
            "overrides": dict(SMALL_MODEL),
            "expert_aux_loss_alpha": 0.01,
            "device_aux_loss_alpha": 0.01,
        },
        "data": {"path": str(data_dir), "num_workers": 1},
        "train": {"steps": STEPS, "micro_batch_size": 4, "grad_accum_steps": 1, "seed": 11},
        "optim": {"lr": 3e-3, "warmup_steps": 1, "schedule": "cosine", "min_lr": 3e-4},
        "checkpoint": {"save_interval": 1, "keep_last": 2},
        "logging": {"log_interval": 1, "tensorboard": True},
    }
    for key, value in sections.items():
        data.setdefault(key, {}).update(value)
    return data


def losses_of(run_dir: Path):
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def weights(ckpt: Path):
    return load_file(str(ckpt / "model.safetensors"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data_dir):
    """STEPS steps in one uninterrupted run, through the CLI."""
    root = tmp_path_factory.mktemp("ref")
    recipe = write_recipe(root, recipe_dict(data_dir))
    run_dir = root / "run"
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["train", str(recipe), "--output", str(run_dir), "--quiet"])
    assert code == 0
    return run_dir, out.getvalue()


def test_cli_run_reports_loss_checkpoint_and_metrics(reference):
    run_dir, stdout = reference
    assert "final loss" in stdout
    assert f"checkpoint: {run_dir / 'checkpoints' / 'step_00000004'}" in stdout
    assert f"metrics:    {run_dir / 'metrics.jsonl'}" in stdout
    assert (run_dir / "recipe.yaml").is_file()
    assert list((run_dir / "tb").iterdir()), "no TensorBoard event file"
    # keep_last 2 with a save every step: only the last two remain, each complete
    kept = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert kept == ["latest", "step_00000003", "step_00000004"]
    assert (run_dir / "checkpoints" / "latest").read_text() == "step_00000004\n"  # the pointer --resume reads
    ckpt = run_dir / "checkpoints" / "step_00000004"
    assert sorted(p.name for p in ckpt.iterdir()) == sorted(
        ["model.safetensors", "optimizer.safetensors", "config.json", "state.json", "recipe.yaml"]
    )
    state = json.loads((ckpt / "state.json").read_text())
    assert state["step"] == 4 and state["data"]["steps"] == 4 and state["tokens_seen"] == 4 * 4 * 32
    assert {"numpy", "mindspore_seed", "mindspore_generator"} <= set(state["rng"])


def test_checkpoint_holds_the_models_own_names_and_optimizer_state(reference):
    run_dir, _ = reference
    ckpt = run_dir / "checkpoints" / "step_00000004"
    model = weights(ckpt)
    assert "model.embed_tokens.weight" in model and "lm_head.weight" in model
    assert model["model.layers.1.mlp.experts.gate_proj.weight"].shape == (8, 16, 32)  # stacked [E, out, in]
    assert not any(k.startswith(("network.", "model.model.")) or "placement" in k for k in model)
    opt = load_file(str(ckpt / "optimizer.safetensors"))
    assert int(opt["global_step"].reshape(-1)[0]) == 4
    assert set(f"adam_m.{k}" for k in model) <= set(opt)
    assert set(f"adam_v.{k}" for k in model) <= set(opt)
    # a training checkpoint loads with from_pretrained
    from ms_deepseek import DeepseekV2ForCausalLM

    loaded = DeepseekV2ForCausalLM.from_pretrained(ckpt, show_progress=False)
    got = {p.name: p.asnumpy() for p in loaded.trainable_params()}
    np.testing.assert_array_equal(got["lm_head.weight"], model["lm_head.weight"])


def test_metrics_records(reference):
    from ms_deepseek.config.recipe import OptimSection
    from ms_deepseek.train.metrics import RECORD_KEYS
    from ms_deepseek.train.optim import lr_fn

    run_dir, _ = reference
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    expected_lr = lr_fn(OptimSection(lr=3e-3, warmup_steps=1, schedule="cosine", min_lr=3e-4), STEPS)
    assert records[0]["compile_s"] > 0 and "tokens_per_s" not in records[0]  # step 1 compiles: no throughput
    assert all("compile_s" not in r for r in records[1:])
    for r in records:
        assert set(RECORD_KEYS) - ({"tokens_per_s"} if r["step"] == 1 else set()) <= set(r)
        assert r["lr"] == pytest.approx(expected_lr(r["step"]), rel=1e-6)
        assert r["total_loss"] > r["loss"] > 0  # balance losses added with their alphas
        assert r["balance_expert"] > 0 and r["balance_device"] > 0
        assert r["grad_norm"] > 0 and r.get("tokens_per_s", 1) > 0
        assert list(r["expert_load"]) == ["1"] and len(r["expert_load"]["1"]) == 8
        assert_close_to_scale(sum(r["expert_load"]["1"]), 1.0, ulps=2, terms=8, dtype=np.float32)  # 8 fractions
        assert r["dropped_fraction"] == {"1": 0.0}  # capacity_factor null: dropless
    assert records[-1]["loss"] < records[0]["loss"]
    assert records[-1]["elapsed_s"] >= records[0]["elapsed_s"]


def test_non_finite_numbers_are_written_as_strings(tmp_path):
    from ms_deepseek.report.metrics_io import read_metrics
    from ms_deepseek.train.metrics import MetricsWriter, json_number

    assert json_number({"a": float("nan"), "b": [float("inf"), -float("inf"), 1.5]}) == {
        "a": "NaN",
        "b": ["Infinity", "-Infinity", 1.5],
    }
    writer = MetricsWriter(tmp_path, tensorboard=False)
    writer.write({"step": 1, "loss": float("nan"), "grad_norm": float("inf")})
    writer.close()
    line = (tmp_path / "metrics.jsonl").read_text()
    assert '"loss": "NaN"' in line and '"grad_norm": "Infinity"' in line
    rec = read_metrics(tmp_path / "metrics.jsonl").records[0]  # the report's reader reads what the writer wrote
    assert math.isnan(rec["loss"]) and rec["grad_norm"] == float("inf")


def test_crash_during_save_then_resume_continues_exactly(reference, data_dir, tmp_path, monkeypatch):
    """N steps, a crash while saving step N+..., --resume: same losses and weights as one run."""
    from ms_deepseek.checkpoint import training as ckpt_mod

    ref_dir, _ = reference
    recipe = write_recipe(tmp_path, recipe_dict(data_dir, checkpoint={"save_interval": 2, "keep_last": 3}))
    run_dir = tmp_path / "run"
    real_save = ckpt_mod.save_tensors

    def crashing_save(named, path):
        if "step_00000004" in str(path.parent) and path.name == "optimizer.safetensors":
            path.write_bytes(b"\x00" * 100)  # half-written file, then the process "dies"
            raise KeyboardInterrupt("simulated crash during save")
        return real_save(named, path)

    monkeypatch.setattr(ckpt_mod, "save_tensors", crashing_save)
    assert main(["train", str(recipe), "--output", str(run_dir), "--quiet"]) == 130
    monkeypatch.setattr(ckpt_mod, "save_tensors", real_save)

    ckpts = run_dir / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir() if p.name.startswith("step_")) == ["step_00000002"]
    # the half-written folder is hidden (a killed process leaves it; an interrupted one removes it)
    assert all(p.name.startswith((".step_00000004.partial-", "step_", "latest")) for p in ckpts.iterdir())
    assert ckpt_mod.resolve_checkpoint("latest", ckpt_mod.RESUME, run_dir) == ckpts / "step_00000002"
    (ckpts / ".step_00000004.partial-killed").mkdir()  # what a SIGKILL mid-save leaves

    assert main(["train", str(recipe), "--output", str(run_dir), "--quiet", "--resume"]) == 0
    assert not any(p.name.startswith(".") for p in ckpts.iterdir())
    assert losses_of(run_dir) == losses_of(ref_dir)  # steps 1-2 from the first run, 3-4 resumed
    got, want = weights(ckpts / "step_00000004"), weights(ref_dir / "checkpoints" / "step_00000004")
    assert got.keys() == want.keys()
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    opt_got = load_file(str(ckpts / "step_00000004" / "optimizer.safetensors"))
    opt_want = load_file(str(ref_dir / "checkpoints" / "step_00000004" / "optimizer.safetensors"))
    for name in opt_want:
        np.testing.assert_array_equal(opt_got[name], opt_want[name], err_msg=name)


def test_gradient_accumulation_matches_one_big_batch(reference, data_dir, tmp_path):
    """2 micro-steps of batch 2 == 1 step of batch 4 (same samples, same update).

    Run with selective recompute, which must not change the math either."""
    from ms_deepseek.config.recipe import load_recipe_dict
    from ms_deepseek.train.context import TrainOptions
    from ms_deepseek.train.trainer import train

    ref_dir, _ = reference
    recipe = load_recipe_dict(
        recipe_dict(
            data_dir,
            train={"micro_batch_size": 2, "grad_accum_steps": 2},
            parallel={"recompute": "selective"},
            logging={"tensorboard": False},
        )
    )
    result = train(recipe, tmp_path / "accum", TrainOptions(progress=False))
    np.testing.assert_allclose(result.losses, losses_of(ref_dir), rtol=1e-5)
    got, want = weights(result.checkpoint), weights(ref_dir / "checkpoints" / "step_00000004")
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=2e-5, err_msg=name)


# --------------------------------------------------------------- the update in isolation


def _update_setup(clip, dynamic, window=1000, dot_norm=None):
    import mindspore as ms
    from mindspore import Parameter, Tensor, nn

    from ms_deepseek.config.recipe import OptimSection
    from ms_deepseek.train import optim
    from ms_deepseek.train.step import LossScaling, Update

    ms.set_seed(0)
    net = nn.Dense(3, 2)
    opt = optim.build_optimizer(net.trainable_params(), OptimSection(lr=0.1, schedule="constant", weight_decay=0.0), 10)
    ms.set_context(mode=ms.GRAPH_MODE)
    scale = Parameter(Tensor(8.0 if dynamic else 1.0, ms.float32), name="loss_scale", requires_grad=False)
    return net, opt, Update(opt, scale, clip, LossScaling(dynamic, window=window), dot_norm=dot_norm), scale


def _grads(values):
    import mindspore as ms

    return tuple(ms.Tensor(np.asarray(g, np.float32)) for g in values)


@pytest.mark.parametrize("dot_norm", [True, False], ids=["cpu-gemv", "grad-scale-marker"])
def test_global_norm_clipping(dot_norm):
    grads = [np.full((2, 3), 3.0), np.full((2,), 4.0)]  # norm sqrt(6*9 + 2*16) = sqrt(86)
    norm = math.sqrt(86.0)
    for clip in (1.0, None, 100.0):
        net, opt, update, _ = _update_setup(clip, dynamic=False, dot_norm=dot_norm)
        grad_norm, lr, overflow, _ = update(_grads(grads))
        assert float(grad_norm.asnumpy()) == pytest.approx(norm, rel=1e-6)  # reported before clipping
        assert not bool(overflow.asnumpy())
        factor = 1.0 / norm if clip == 1.0 else 1.0
        # Adam's first moment after one step is (1 - beta1) * g: the clipped gradient, exactly
        m = opt.exp_avg[0].asnumpy()
        np.testing.assert_allclose(m, 0.1 * grads[0] * factor, rtol=1e-5)


@pytest.mark.parametrize("dot_norm", [True, False], ids=["cpu-gemv", "grad-scale-marker"])
def test_dynamic_loss_scale_skips_overflow_and_grows(dot_norm):
    net, opt, update, scale = _update_setup(None, dynamic=True, window=2, dot_norm=dot_norm)
    before = net.weight.asnumpy().copy()
    _, _, overflow, used = update(_grads([np.full((2, 3), np.inf), np.ones(2)]))
    assert bool(overflow.asnumpy()) and float(used.asnumpy()) == 8.0
    assert float(scale.asnumpy()) == 4.0  # halved
    np.testing.assert_array_equal(net.weight.asnumpy(), before)  # step skipped
    assert int(opt.global_step.asnumpy().reshape(-1)[0]) == 0
    for _ in range(2):  # two good steps -> doubled
        grad_norm, _, overflow, _ = update(_grads([np.full((2, 3), 2.0), np.full((2,), 2.0)]))
        assert not bool(overflow.asnumpy())
        # scaled gradients: 2.0 / scale 4 = 0.5 per element, 8 elements
        assert float(grad_norm.asnumpy()) == pytest.approx(math.sqrt(8 * 0.5**2), rel=1e-6)
    assert float(scale.asnumpy()) == 8.0
    assert int(opt.global_step.asnumpy().reshape(-1)[0]) == 2
    assert not np.array_equal(net.weight.asnumpy(), before)


# --------------------------------------------------------------- bad input stops before training


@pytest.mark.parametrize(
    "case",
    ["empty_folder", "corrupt_meta", "corrupt_shard", "too_few_samples", "missing_tokenizer", "too_long", "vocab"],
)
def test_bad_data_stops_with_one_line_before_training(case, data_dir, tmp_path, capsys):
    import shutil

    data = recipe_dict(data_dir)
    key = "data.path"
    if case == "empty_folder":
        (tmp_path / "empty").mkdir()
        data["data"]["path"] = str(tmp_path / "empty")
    elif case == "corrupt_meta":
        bad = tmp_path / "corrupt"
        shutil.copytree(data_dir, bad)
        (bad / "meta.json").write_text("{not json")
        data["data"]["path"] = str(bad)
        key = "meta.json"
    elif case == "corrupt_shard":
        bad = tmp_path / "corrupt"
        shutil.copytree(data_dir, bad)
        shard = next(p for p in bad.iterdir() if p.suffix == ".mindrecord")
        shard.write_bytes(shard.read_bytes()[:1000])  # truncated
        data["data"]["path"] = str(bad)
        key = "cannot read the training samples"
    elif case == "too_few_samples":
        data["train"]["micro_batch_size"] = 50_000  # more rows than the folder holds (and within the MoE's limit)
        key = "fewer than one global batch"
    elif case == "missing_tokenizer":
        data["data"]["tokenizer"] = str(tmp_path / "no_such_tokenizer.model")
        key = "data.tokenizer"
    elif case == "too_long":
        data["model"]["overrides"]["max_position_embeddings"] = 16  # the data has 32-token windows
        key = "data.seq_len"
    else:
        data["model"]["overrides"]["vocab_size"] = 256  # the data's tokenizer has 512
        key = "data.path"
    recipe = write_recipe(tmp_path, data)
    run_dir = tmp_path / "run"
    assert main(["train", str(recipe), "--output", str(run_dir), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("ms-deepseek train: error:") and "\n" not in err and key in err, err
    assert not run_dir.exists(), "nothing may start before the data is checked"


def test_flash_attention_on_cpu_stops_with_one_line_before_anything_is_built(data_dir, tmp_path, capsys):
    data = recipe_dict(data_dir, model={"overrides": dict(SMALL_MODEL, use_flash_attention=True)})
    recipe = write_recipe(tmp_path, data)
    run_dir = tmp_path / "run"
    assert main(["train", str(recipe), "--output", str(run_dir), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "model.overrides.use_flash_attention" in err and "Ascend" in err, err
    assert not run_dir.exists()


def test_resume_errors_are_clear(tmp_path, data_dir):
    from ms_deepseek.checkpoint.training import RESUME, resolve_checkpoint

    with pytest.raises(UserError, match="no complete checkpoint"):
        resolve_checkpoint("latest", RESUME, tmp_path)
    (tmp_path / "step_00000002").mkdir()
    with pytest.raises(UserError, match="incomplete checkpoint"):
        resolve_checkpoint(str(tmp_path / "step_00000002"), RESUME, tmp_path)


def test_a_fresh_run_never_overwrites_a_run_with_checkpoints(reference, capsys):
    run_dir, _ = reference
    before = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert main(["train", str(run_dir.parent / "recipe.yaml"), "--output", str(run_dir), "--quiet"]) == 2
    assert "already holds checkpoints (newest step_00000004); pass --resume" in capsys.readouterr().err
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == before
    # a resume of a finished run (a restart loop re-running the command) is a success that does nothing
    metrics_before = (run_dir / "metrics.jsonl").read_text()
    assert main(["train", str(run_dir.parent / "recipe.yaml"), "--output", str(run_dir), "--resume"]) == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith("run complete:") and "at step 4 of train.steps=4" in out and "\n" not in out
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == before
    assert (run_dir / "metrics.jsonl").read_text() == metrics_before


def test_resume_auto_starts_fresh_then_resumes_then_says_complete(reference, data_dir, tmp_path, capsys):
    """A restart loop: the same command (`--resume auto`, or checkpoint.resume: auto) after every stop."""
    ref_dir, _ = reference
    recipe = write_recipe(tmp_path, recipe_dict(data_dir))
    run_dir = tmp_path / "run"
    # no checkpoint yet: a fresh start (stopped after 2 steps, as a crash would)
    assert (
        main(["train", str(recipe), "--output", str(run_dir), "--quiet", "--resume", "auto", "--max-steps", "2"]) == 0
    )
    assert "starting:" in capsys.readouterr().out
    # a complete checkpoint exists: resumed from it, and the run continues exactly
    auto = write_recipe(tmp_path / "auto", recipe_dict(data_dir, checkpoint={"resume": "auto"}))
    assert main(["train", str(auto), "--output", str(run_dir), "--quiet"]) == 0
    assert f"resuming {run_dir / 'checkpoints' / 'step_00000002'} at step 2" in capsys.readouterr().out
    assert losses_of(run_dir) == losses_of(ref_dir)
    got, want = weights(run_dir / "checkpoints" / "step_00000004"), weights(ref_dir / "checkpoints" / "step_00000004")
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    # the run is finished: the same command again exits 0 with one line
    assert main(["train", str(recipe), "--output", str(run_dir), "--quiet", "--resume", "auto"]) == 0
    assert capsys.readouterr().out.startswith("run complete:")
    with pytest.raises(UserError, match="checkpoint.resume: must be 'auto' or null"):
        from ms_deepseek.config.recipe import load_recipe_dict

        load_recipe_dict(recipe_dict(data_dir, checkpoint={"resume": "latest"}))


def test_float16_compute_trains_with_a_dynamic_loss_scale(reference, data_dir, tmp_path, monkeypatch, capsys):
    from ms_deepseek.config.recipe import load_recipe_dict
    from ms_deepseek.report.alerts import AlertConfig, AlertMonitor
    from ms_deepseek.train import run_log
    from ms_deepseek.train.context import TrainOptions
    from ms_deepseek.train.trainer import train

    ref_dir, _ = reference
    # alerts are printed as they open (a threshold every step crosses, to see the wiring)
    monkeypatch.setattr(run_log, "alert_monitor", lambda: AlertMonitor(AlertConfig(streak=2, grad_high=1e-3)))
    data = recipe_dict(data_dir, checkpoint={"save_interval": 0}, logging={"tensorboard": False})
    data["model"]["overrides"]["compute_dtype"] = "float16"
    result = train(load_recipe_dict(data), tmp_path / "fp16", TrainOptions(progress=False))
    records = [json.loads(line) for line in (tmp_path / "fp16" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["loss_scale"] == 65536.0 and r["overflow"] is False for r in records)
    np.testing.assert_allclose(result.losses, losses_of(ref_dir), rtol=5e-3)  # float16 matmuls, fp32 master
    out = capsys.readouterr().out
    assert out.count("ALERT [alert:grad_norm_high] steps 1-2: gradient norm above 0.001") == 1, out


def test_model_source_checkpoint_folder_starts_from_its_weights(reference, data_dir, tmp_path):
    """model.source = a checkpoint folder: its weights are loaded (not a random init), overrides still apply."""
    from ms_deepseek.config.recipe import load_recipe_dict
    from ms_deepseek.train.context import TrainOptions
    from ms_deepseek.train.trainer import train

    ref_dir, _ = reference
    data = recipe_dict(data_dir, train={"steps": 1}, checkpoint={"save_interval": 0}, logging={"tensorboard": False})
    data["model"] = {"source": str(ref_dir / "checkpoints" / "step_00000004"), "overrides": {"capacity_factor": 4.0}}
    recipe = load_recipe_dict(data)
    assert recipe.weights_folder is not None and recipe.model_config.capacity_factor == 4.0
    result = train(recipe, tmp_path / "finetune", TrainOptions(progress=False))
    # the first batch again, now seen by the trained weights: lower loss than at random init
    assert result.losses[0] < losses_of(ref_dir)[0] - 0.02
    cfg = json.loads((result.checkpoint / "config.json").read_text())
    assert cfg["hidden_size"] == 32 and cfg["num_hidden_layers"] == 2


def test_training_checkpoint_exports_to_huggingface(reference, tmp_path):
    from ms_deepseek import DeepseekV2ForCausalLM

    run_dir, _ = reference
    ckpt = run_dir / "checkpoints" / "step_00000004"
    assert main(["convert", "ms-to-hf", str(ckpt), str(tmp_path / "hf")]) == 0
    hf = {}
    for f in (tmp_path / "hf").glob("*.safetensors"):
        hf.update(load_file(str(f)))
    ours = weights(ckpt)
    stacked = ours["model.layers.1.mlp.experts.up_proj.weight"]  # [E, out, in]
    for e in range(8):
        np.testing.assert_array_equal(hf[f"model.layers.1.mlp.experts.{e}.up_proj.weight"], stacked[e])
    back = DeepseekV2ForCausalLM.from_pretrained(tmp_path / "hf", show_progress=False)
    got = {p.name: p.asnumpy() for p in back.trainable_params()}
    for name, value in ours.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)


def test_pynative_mode_trains_the_same(reference, data_dir, tmp_path):
    from ms_deepseek.config.recipe import load_recipe_dict
    from ms_deepseek.train.context import TrainOptions
    from ms_deepseek.train.trainer import train

    ref_dir, _ = reference
    data = recipe_dict(
        data_dir,
        train={"mode": "pynative"},
        checkpoint={"save_interval": 0, "save_final": False},
        logging={"tensorboard": False},
    )
    result = train(load_recipe_dict(data), tmp_path / "pynative", TrainOptions(progress=False, max_steps=2))
    np.testing.assert_allclose(result.losses, losses_of(ref_dir)[:2], rtol=1e-5)
    assert result.checkpoint is None


def test_weight_decay_skips_norms_biases_and_routers():
    import mindspore as ms
    from mindspore import Parameter, Tensor

    from ms_deepseek.config.recipe import OptimSection
    from ms_deepseek.train import optim
    from ms_deepseek.train.step import Update

    names = [
        "model.layers.0.self_attn.o_proj.weight",
        "model.norm.weight",
        "model.layers.1.mlp.gate.weight",
        "model.layers.0.self_attn.kv_a_layernorm.weight",
    ]
    params = [Parameter(Tensor(np.ones((2, 2), np.float32)), name=n) for n in names]
    opt = optim.build_optimizer(params, OptimSection(lr=0.5, schedule="constant", weight_decay=0.1), 10)
    ms.set_context(mode=ms.GRAPH_MODE)
    scale = Parameter(Tensor(1.0, ms.float32), name="loss_scale", requires_grad=False)
    Update(opt, scale, None)(tuple(Tensor(np.zeros((2, 2), np.float32)) for _ in names))
    got = {n: float(p.asnumpy()[0, 0]) for n, p in zip(names, params)}
    assert got[names[0]] == pytest.approx(1.0 - 0.5 * 0.1)  # decoupled decay, zero gradient
    assert got[names[1]] == got[names[2]] == got[names[3]] == 1.0


def test_resume_truncates_metrics_past_the_checkpoint(tmp_path):
    from ms_deepseek.train.metrics import truncate_after

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 5.0}\n{"step": 2, "loss": 4.0}\n{"step": 3, "loss": 3.0}\n{"step": 4, "lo')
    truncate_after(path, 2)
    assert path.read_text() == '{"step": 1, "loss": 5.0}\n{"step": 2, "loss": 4.0}\n'
