"""LoRA training: only adapters train and are saved, the base stays bit-identical, resume after a
kill is exact, the tiny LoRA recipe lowers the loss, and the export reproduces the committed
adapter that PEFT was checked against (tests/fixtures/lora, see test_lora.py)."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from safetensors.numpy import load_file

from ms_deepseek.cli import main

from builders import SMALL_MODEL, kill_during_save_then_resume
from repo_paths import FIXTURES, REPO
from tolerances import assert_close_to_scale

FIX = FIXTURES / "lora"
# logits computed two ways (another framework, another order of the float32 reductions): 2 ulps of the
# largest logit per term of the longest reduction, the hidden size
TOL = dict(ulps=2, terms=json.loads((FIX / "base" / "config.json").read_text())["hidden_size"])


def _maker():
    spec = importlib.util.spec_from_file_location("make_lora_reference", FIX.parent / "make_lora_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    from ms_deepseek.data.prepare import prepare_embedded_default

    out = tmp_path_factory.mktemp("data") / "corpus"
    # as make_lora_reference.py's `ours` step
    prepare_embedded_default(out, seq_len=_maker().SEQ, vocab_size=512, max_bytes=60_000, progress=False)
    return out


def _fixture_recipe(data_dir, **changes):
    recipe = json.loads(json.dumps(_maker().OURS_RECIPE))
    recipe["lora"]["target_modules"] = list(_maker().shipped_targets())  # as the fixture was made
    recipe["model"] = {"source": str(FIX / "base"), "overrides": {"capacity_factor": None}}
    recipe["data"] = {"path": str(data_dir), "num_workers": 1}
    for key, value in changes.items():
        recipe.setdefault(key, {}).update(value)
    return recipe


def _run(recipe_dict, run_dir: Path):
    from ms_deepseek.config.recipe import load_recipe_dict
    from ms_deepseek.train.context import TrainOptions
    from ms_deepseek.train.trainer import build_trainer, start_run

    trainer = build_trainer(start_run(load_recipe_dict(recipe_dict), run_dir, TrainOptions(progress=False)))
    return trainer, trainer.run()


def _base_params(model):
    from ms_deepseek.config import names

    E = model.config.n_routed_experts
    out = {}
    for name, p in model.parameters_and_names():
        if ".lora_" in name or name.endswith("expert_placement"):
            continue
        for hf, arr in names.unstack(name, p.asnumpy(), E):
            out[hf] = arr
    return out


@pytest.fixture(scope="module")
def fixture_run(tmp_path_factory, data_dir):
    root = tmp_path_factory.mktemp("lora_run")
    trainer, result = _run(_fixture_recipe(data_dir, checkpoint={"save_interval": 1, "keep_last": 3}), root / "run")
    return trainer, result


def test_training_saves_only_adapters_and_keeps_the_base_bit_identical(fixture_run):
    trainer, result = fixture_run
    assert result.steps == 3
    ckpt = load_file(str(result.checkpoint / "model.safetensors"))
    assert ckpt and all(".lora_A.weight" in n or ".lora_B.weight" in n for n in ckpt)
    assert "model.layers.1.mlp.experts.gate_proj.lora_A.weight" in ckpt  # stacked [E, r, H]
    assert ckpt["model.layers.1.mlp.experts.gate_proj.lora_A.weight"].shape == (4, 4, 32)
    assert any(np.abs(v).max() > 0 for n, v in ckpt.items() if "lora_B" in n)  # B left zero init
    opt = load_file(str(result.checkpoint / "optimizer.safetensors"))
    moments = [n for n in opt if n.startswith(("adam_m.", "adam_v.", "moment1.", "moment2."))]
    assert moments and all(".lora_" in n for n in moments), sorted(opt)[:6]
    # every base weight in memory after training equals the base file, bit for bit (bfloat16 widened)
    from ms_deepseek.checkpoint.weight_files import read_weight_files
    from ms_deepseek.model.loading import read_tensor

    base = read_weight_files(FIX / "base")
    got = _base_params(trainer.tensors.model)
    assert got.keys() == base.tensors.keys()
    for name, info in base.tensors.items():
        np.testing.assert_array_equal(got[name], read_tensor(info), err_msg=name)
    assert not any(p.requires_grad for n, p in trainer.tensors.model.parameters_and_names() if ".lora_" not in n)


def test_export_reproduces_the_adapter_peft_was_checked_against(fixture_run, tmp_path):
    """The fixture's ours_adapter came from this same run: PEFT on transformers reproduced our logits
    with it (test_lora.py), so a fresh run exported here must give the same tensors."""
    _trainer, result = fixture_run
    out = tmp_path / "adapter"
    assert main(["export-lora", str(result.run_dir), str(out), "--base", "tests/fixtures/lora/base"]) == 0
    got, want = (
        load_file(str(out / "adapter_model.safetensors")),
        load_file(str(FIX / "ours_adapter" / "adapter_model.safetensors")),
    )
    assert got.keys() == want.keys()
    for name in want:
        # each step's update carries its gradient's reduction error (over the hidden size): steps add them up
        assert_close_to_scale(got[name], want[name], ulps=2, terms=TOL["terms"] * result.steps, err_msg=name)
    assert json.loads((out / "adapter_config.json").read_text()) == json.loads(
        (FIX / "ours_adapter" / "adapter_config.json").read_text()
    )
    # and this run's export gives the logits PEFT computed on transformers with the committed one
    import mindspore as ms

    from ms_deepseek.model.causal_lm import DeepseekV2ForCausalLM

    ref = load_file(str(FIX / "reference.safetensors"))
    model = DeepseekV2ForCausalLM.from_pretrained(str(FIX / "base"), adapter=str(out), show_progress=False)
    model.set_train(False)
    got_logits = model(ms.Tensor(ref["input_ids"])).logits.asnumpy()
    assert_close_to_scale(got_logits, ref["logits_ours_adapter"], **TOL)


def test_resume_after_a_kill_is_exact(fixture_run, data_dir, tmp_path, monkeypatch):
    _trainer, ref = fixture_run
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(_fixture_recipe(data_dir, checkpoint={"save_interval": 1, "keep_last": 3})))
    run_dir = tmp_path / "run"
    kill_during_save_then_resume(monkeypatch, recipe, run_dir)

    def losses(d):
        return [json.loads(line)["loss"] for line in (d / "metrics.jsonl").read_text().splitlines()]

    assert losses(run_dir) == losses(ref.run_dir)
    for file in ("model.safetensors", "optimizer.safetensors"):
        got = load_file(str(run_dir / "checkpoints" / "step_00000003" / file))
        want = load_file(str(ref.run_dir / "checkpoints" / "step_00000003" / file))
        assert got.keys() == want.keys()
        for name in want:
            np.testing.assert_array_equal(got[name], want[name], err_msg=f"{file}: {name}")


def test_tiny_lora_recipe_lowers_the_loss_and_exports(tmp_path, data_dir):
    """recipes/tiny-lora-cpu.yaml (random base, saved to RUN_DIR/base), shrunk to a few graph-mode steps,
    with lora.train_router."""
    import mindspore as ms

    from ms_deepseek.config.recipe import load_recipe
    from ms_deepseek.model.causal_lm import DeepseekV2ForCausalLM

    sets = [
        "data.path=" + str(data_dir),
        "data.seq_len=null",
        "train.steps=30",
        "train.micro_batch_size=4",
        "optim.warmup_steps=2",
        "optim.lr=0.02",
        "model.overrides.initializer_range=0.2",  # logits of a 0.02-init random base barely move "checkpoint.save_interval=0", "logging.log_interval=1",
        "logging.tensorboard=false",
        "lora.train_router=true",
    ]  # the recipe's dropout 0.05 stays
    sets += [f"model.overrides.{k}={'null' if v is None else v}" for k, v in SMALL_MODEL.items()]
    recipe = load_recipe(REPO / "recipes" / "tiny-lora-cpu.yaml", sets)
    from ms_deepseek.train.context import TrainOptions
    from ms_deepseek.train.trainer import build_trainer, start_run

    run_dir = tmp_path / "run"
    trainer = build_trainer(start_run(recipe, run_dir, TrainOptions(progress=False)))
    result = trainer.run()
    first, last = np.mean(result.losses[:5]), np.mean(result.losses[-5:])
    assert last < first - 0.1, result.losses
    assert (run_dir / "base" / "model.safetensors").is_file()
    base = load_file(str(run_dir / "base" / "model.safetensors"))
    got = _base_params(trainer.tensors.model)
    assert got.keys() == base.keys()
    routers = [n for n in base if n.endswith(".mlp.gate.weight")]
    assert routers
    for name in base:
        if name in routers:  # lora.train_router: the routers train (and are exported) with the adapters
            assert not np.array_equal(got[name], base[name]), name
        else:
            np.testing.assert_array_equal(got[name], base[name], err_msg=name)
    # export, reload as base + adapter: the trained model's logits
    assert main(["export-lora", str(run_dir), str(tmp_path / "adapter")]) == 0
    ids = np.arange(24, dtype=np.int32).reshape(2, 12) % 512
    trainer.tensors.model.set_train(False)
    ms.set_context(mode=ms.PYNATIVE_MODE)
    want = trainer.tensors.model(ms.Tensor(ids)).logits.asnumpy()
    cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == str(run_dir / "base")
    assert cfg["modules_to_save"] == ["gate"]  # PEFT's own format for a trained router (checked with PEFT 0.21.2)
    exported = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    for name in routers:
        np.testing.assert_array_equal(exported["base_model.model." + name], got[name])
    reloaded = DeepseekV2ForCausalLM.from_pretrained(
        str(run_dir / "base"), adapter=str(tmp_path / "adapter"), show_progress=False
    )
    reloaded.set_train(False)
    assert_close_to_scale(reloaded(ms.Tensor(ids)).logits.asnumpy(), want, ulps=2, terms=SMALL_MODEL["hidden_size"])


# ---------------------------------------------------------------------------- sharded LoRA checkpoints
SHARDED = ["--dp", "2", "--tp", "2", "--pp", "2", "--ep", "2"]


def _parallel(**degrees):
    from ms_deepseek.config.parallel import ParallelConfig

    return ParallelConfig(**{"micro_batches": degrees.get("pp", 1), **degrees})


def test_sharded_lora_checkpoint_exports_merges_and_resumes_like_the_whole_one(fixture_run, data_dir, tmp_path, capsys):
    """A tp / pp / ep LoRA run's checkpoint (rank_*/ slices of the adapters, as the trainer's sharded save writes
    them: reshard gives the same layout file) exports the same PEFT adapter and merged folder as the whole one,
    reshards back to it, and resumes on one device with the same losses."""
    import filecmp

    from ms_deepseek.checkpoint.layout import build_layout, read_layout
    from ms_deepseek.config.recipe import load_recipe_dict

    _trainer, ref = fixture_run
    whole = ref.run_dir / "checkpoints" / "step_00000002"
    sharded = tmp_path / "sharded"
    assert main(["convert", "reshard", str(whole), str(sharded), *SHARDED, "--no-progress"]) == 0
    layout = read_layout(sharded)
    recipe = load_recipe_dict(_fixture_recipe(data_dir))
    par = _parallel(dp=2, tp=2, pp=2, ep=2)
    # what the trainer's _layout writes into a sharded LoRA checkpoint
    trainer_layout = build_layout(recipe.model_config, par, lora=recipe.lora)
    assert layout.to_json()["tensors"] == trainer_layout.to_json()["tensors"]
    assert layout.lora.settings() == {
        "r": recipe.lora.r,
        "target_modules": list(recipe.lora.target_modules),
        "train_router": False,
    }
    saved = load_file(str(whole / "model.safetensors"))
    assert set(layout.tensors) == set(saved)  # adapters only: no base weight in the layout or the rank files
    # adapters split like their base layers: column-parallel B by tp, row-parallel A by tp, experts by ep
    assert layout.tensors["model.layers.0.self_attn.q_b_proj.lora_B.weight"].split == (2, 1)
    assert layout.tensors["model.layers.0.self_attn.o_proj.lora_A.weight"].split == (1, 2)
    assert layout.tensors["model.layers.1.mlp.experts.gate_proj.lora_B.weight"].split == (2, 2, 1)
    assert layout.optimizer["adam_m.model.layers.1.mlp.experts.down_proj.lora_A.weight"].split == (2, 1, 2)
    for rank in range(layout.world_size):
        held = load_file(str(sharded / f"rank_{rank:05d}" / "model.safetensors"))
        assert sorted(held) == sorted(layout.stored_in(rank))  # each distinct slice once

    # export: PEFT folder and merged HF folder, the same bytes from either checkpoint
    base = str(FIX / "base")
    for src, name in ((whole, "w"), (sharded, "s")):
        assert main(["export-lora", str(src), str(tmp_path / f"adapter_{name}"), "--base", base]) == 0
        assert main(["export-lora", str(src), str(tmp_path / f"merged_{name}"), "--merge", base]) == 0
    for folder, file in (
        ("adapter", "adapter_model.safetensors"),
        ("adapter", "adapter_config.json"),
        ("merged", "model.safetensors"),
    ):
        assert filecmp.cmp(tmp_path / f"{folder}_w" / file, tmp_path / f"{folder}_s" / file, shallow=False), file

    # back to a whole checkpoint: every tensor (model and optimizer) as saved
    assert main(["convert", "reshard", str(sharded), str(tmp_path / "back"), "--dp", "1", "--no-progress"]) == 0
    for file in ("model.safetensors", "optimizer.safetensors"):
        got, want = load_file(str(tmp_path / "back" / file)), load_file(str(whole / file))
        assert got.keys() == want.keys()
        for name in want:
            np.testing.assert_array_equal(got[name], want[name], err_msg=f"{file}: {name}")

    # resume on one device from the sharded checkpoint: step 3 as the uninterrupted run had it
    recipe_file = tmp_path / "r.yaml"
    recipe_file.write_text(yaml.safe_dump(_fixture_recipe(data_dir, checkpoint={"save_interval": 1, "keep_last": 3})))
    assert (
        main(["train", str(recipe_file), "--output", str(tmp_path / "run2"), "--quiet", "--resume", str(sharded)]) == 0
    )

    def losses(d):
        return {
            json.loads(line)["step"]: json.loads(line)["loss"]
            for line in (d / "metrics.jsonl").read_text().splitlines()
        }

    assert losses(tmp_path / "run2") == {3: losses(ref.run_dir)[3]}
    got = load_file(str(tmp_path / "run2" / "checkpoints" / "step_00000003" / "model.safetensors"))
    want = load_file(str(ref.run_dir / "checkpoints" / "step_00000003" / "model.safetensors"))
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)

    # a LoRA checkpoint has no HF form of its own: convert says what to run instead
    capsys.readouterr()
    assert main(["convert", "ms-to-hf", str(sharded), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "a LoRA checkpoint holds adapters" in err[0] and "export-lora" in err[0], err
    assert not (tmp_path / "hf").exists()

    # a damaged sharded LoRA checkpoint: one line naming what is wrong, nothing written
    import shutil

    for damage, pattern in (("rank", "rank_00003: missing rank folder"), ("lora", "malformed layout file")):
        broken = tmp_path / f"broken_{damage}"
        shutil.copytree(sharded, broken)
        if damage == "rank":
            shutil.rmtree(broken / "rank_00003")
        else:
            data = json.loads((broken / "layout.json").read_text())
            data["lora"] = {"r": "four"}
            (broken / "layout.json").write_text(json.dumps(data))
        assert main(["export-lora", str(broken), str(tmp_path / f"out_{damage}"), "--base", base]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and pattern in err[0] and "Traceback" not in err[0], err
        assert not (tmp_path / f"out_{damage}").exists()


def test_sharded_lora_model_builds_lazily_and_saves_what_its_layout_lists(data_dir):
    """The trainer's sharded LoRA build, short of the compile: the base built without data, adapters attached
    with theirs; what the checkpoint saves (adapters, routers with train_router) is exactly what the layout
    lists, at full shape; a rank then takes its slices of the frozen base from model.source."""
    from mindspore.nn.utils import no_init_parameters

    from ms_deepseek.checkpoint.layout import build_layout, slice_array
    from ms_deepseek.checkpoint.opener import open_checkpoint
    from ms_deepseek.checkpoint.slice_readers import full_slice, to_float32
    from ms_deepseek.checkpoint.tensors import model_tensors, restore_into
    from ms_deepseek.config.recipe import load_recipe_dict
    from ms_deepseek.model.causal_lm import DeepseekV2ForCausalLM
    from ms_deepseek.train import lora_run

    recipe = load_recipe_dict(_fixture_recipe(data_dir, lora={"train_router": True}))
    cfg, par = recipe.model_config, _parallel(dp=2, tp=2, pp=2, ep=2)
    with no_init_parameters():
        model = DeepseekV2ForCausalLM(cfg)
    lora_run.prepare(model, recipe, Path("unused"), write_base=False)
    saved = lora_run.LoraModel().checkpoint_tensors(model)
    adapters = {n: p for n, p in saved.items() if ".lora_" in n}
    assert adapters and all(not p.has_init for p in adapters.values()), "adapters without data"
    layout = build_layout(cfg, par, lora=recipe.lora)
    assert {n: tuple(p.shape) for n, p in saved.items()} == {n: t.shape for n, t in layout.tensors.items()}
    assert any(n.endswith("mlp.gate.weight") for n in layout.tensors)  # train_router
    base_layout = build_layout(cfg, par)
    base_params = {n: p for n, p in model_tensors(model).items() if n in base_layout.tensors}
    # the routers (trained here) are base weights too: they come from model.source like the rest
    assert all(p.has_init for p in base_params.values()), "the lazy build allocated the base"
    rank = 5
    mine = {n: base_params[n] for n in base_layout.tensors_of_rank(rank)}
    src = open_checkpoint(FIX / "base").model
    restore_into(mine, src, "model", layout=base_layout, rank=rank)
    for name, param in mine.items():
        t = base_layout.tensors[name]
        full = src.read(name, full_slice(t.shape, t.experts is not None))
        expect = to_float32(slice_array(full, base_layout.slice_of(name, rank)), src.dtype(name))
        np.testing.assert_array_equal(param.asnumpy(), expect, err_msg=name)


@pytest.mark.parametrize("command", ["train", "launch"])
def test_sharded_lora_run_needs_a_base_checkpoint(tmp_path, capsys, command):
    """Every rank of a sharded LoRA run reads its slices of model.source: a random base is refused up front
    (launch: before any worker starts), and planning such a layout still works."""
    recipe = str(REPO / "recipes" / "tiny-lora-cpu.yaml")
    sets = ["--set", "parallel.dp=2", "--set", "parallel.tp=2"]
    capsys.readouterr()
    code = main(
        [command, recipe, "--output", str(tmp_path / "run"), *sets] + (["--quiet"] if command == "train" else [])
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"ms-deepseek {command}: error: {recipe}: lora: a sharded LoRA run (dp2 tp2"), err[0]
    assert "model.source" in err[0]
    assert not (tmp_path / "run").exists()
    assert main(["plan", "--recipe", recipe, *sets]) == 0


def test_a_whole_lora_checkpoint_generates_with_its_adapters_and_other_commands_name_export_lora(
    fixture_run, tmp_path, capsys
):
    """generate RUN_DIR of a LoRA run samples from its base with the checkpoint's adapters applied (the
    logits PEFT computed with this run's adapter); convert ms-to-hf and from_pretrained say, in one
    line, to use export-lora (or --merge)."""
    import mindspore as ms

    from ms_deepseek.core.errors import UserError
    from ms_deepseek.model.causal_lm import DeepseekV2ForCausalLM
    from ms_deepseek.model.lora_export import model_with_adapters

    _trainer, result = fixture_run
    ref = load_file(str(FIX / "reference.safetensors"))
    model = model_with_adapters(result.checkpoint)
    model.set_train(False)
    assert_close_to_scale(model(ms.Tensor(ref["input_ids"])).logits.asnumpy(), ref["logits_ours_adapter"], **TOL)
    capsys.readouterr()
    assert main(["generate", str(result.run_dir), "--prompt-ids", "5,6,7", "--max-new-tokens", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ids"][:3] == [5, 6, 7] and len(out["ids"]) == 6
    code = main(["convert", "ms-to-hf", str(result.checkpoint), str(tmp_path / "hf")])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "export-lora" in err and "--merge" in err
    assert not (tmp_path / "hf").exists()
    with pytest.raises(UserError, match="export-lora .*--merge"):
        DeepseekV2ForCausalLM.from_pretrained(str(result.checkpoint), show_progress=False)


@pytest.mark.parametrize("where", ["run", "inside_run", "holds_run", "run_base"])
def test_export_refuses_an_output_that_is_holds_or_lies_inside_the_run(fixture_run, tmp_path, where, capsys):
    """`export-lora RUN RUN --overwrite` does not replace the run folder (checkpoints, base, metrics) with the
    adapter: every overlap of OUT with an input is refused, nothing is touched."""
    import shutil

    _trainer, result = fixture_run
    run, base = tmp_path / "runs" / "run", tmp_path / "base"
    shutil.copytree(result.run_dir, run)
    shutil.copytree(FIX / "base", base)  # never the committed fixture: the old code replaced it
    out = {"run": run, "inside_run": run / "adapter", "holds_run": run.parent, "run_base": base}[where]
    before = sorted(str(p) for p in [*run.rglob("*"), *base.rglob("*")])
    code = main(["export-lora", str(run), str(out), "--overwrite", "--base", str(base)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "input folder" in err[0], err
    assert sorted(str(p) for p in [*run.rglob("*"), *base.rglob("*")]) == before


@pytest.mark.slow
def test_dropout_is_exact_across_runs_and_resume(data_dir, tmp_path):
    """LoRA dropout is a stateless hash of (seed, step, rank, adapter, element), not MindSpore's Dropout kernel
    (which keeps its random state inside, so a resumed run would draw other masks and two seeded graph-mode runs
    on CPU part): two runs and a run resumed halfway give the same losses and adapters, bit for bit."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        yaml.safe_dump(
            _fixture_recipe(
                data_dir,
                lora={"dropout": 0.3},
                train={"steps": 4, "mode": "graph"},
                checkpoint={"save_interval": 2, "keep_last": 3},
            )
        )
    )

    def losses(d):
        return [json.loads(line)["loss"] for line in (d / "metrics.jsonl").read_text().splitlines()]

    for name in ("a", "b"):
        assert main(["train", str(recipe), "--output", str(tmp_path / name), "--quiet"]) == 0
    assert main(["train", str(recipe), "--output", str(tmp_path / "c"), "--quiet", "--max-steps", "2"]) == 0
    assert main(["train", str(recipe), "--output", str(tmp_path / "c"), "--quiet", "--resume"]) == 0
    assert len(losses(tmp_path / "a")) == 4
    assert losses(tmp_path / "b") == losses(tmp_path / "a")
    assert losses(tmp_path / "c") == losses(tmp_path / "a")
    want = load_file(str(tmp_path / "a" / "checkpoints" / "step_00000004" / "model.safetensors"))
    for name in ("b", "c"):
        got = load_file(str(tmp_path / name / "checkpoints" / "step_00000004" / "model.safetensors"))
        for key in want:
            np.testing.assert_array_equal(got[key], want[key], err_msg=f"{name}: {key}")
    # and dropout acts: the same run without it trains to other losses
    recipe.write_text(
        yaml.safe_dump(
            _fixture_recipe(
                data_dir, lora={"dropout": 0.0}, train={"steps": 4, "mode": "graph"}, checkpoint={"save_interval": 2}
            )
        )
    )
    assert main(["train", str(recipe), "--output", str(tmp_path / "none"), "--quiet"]) == 0
    assert losses(tmp_path / "none")[1:] != losses(tmp_path / "a")[1:]
