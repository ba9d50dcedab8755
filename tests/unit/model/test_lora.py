"""LoRA adapters against transformers + PEFT (fixtures in tests/fixtures/lora, made by
tests/fixtures/make_lora_reference.py), the streaming merge, and the refusals of bad input.

* ``peft_adapter``: made by PEFT 0.21.2 itself on transformers 5.24's model (random, nonzero
  A and B; on transformers 5 PEFT puts gate/up/down_proj on the fused routed experts);
* ``ours_adapter``: three LoRA steps of our trainer on ``base``, exported by ``export-lora``;
  PEFT applied it to the transformers model for ``logits_ours_adapter``, and plain transformers
  loaded our ``--merge`` output for ``logits_merged``.
"""

import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from ms_deepseek.cli import main
from ms_deepseek.config.lora import LoraSpec
from ms_deepseek.core.errors import UserError

from repo_paths import FIXTURES
from tolerances import assert_close_to_scale

FIX = FIXTURES / "lora"
# logits computed two ways (another framework, another order of the float32 reductions): 2 ulps of the
# largest logit per term of the longest reduction, the hidden size
TOL = dict(ulps=2, terms=json.loads((FIX / "base" / "config.json").read_text())["hidden_size"])


@pytest.fixture(scope="module")
def ref():
    return load_file(str(FIX / "reference.safetensors"))


def _logits(model, ids):
    import mindspore as ms

    model.set_train(False)
    return model(ms.Tensor(ids)).logits.asnumpy()


def _load(base, adapter=None):
    from ms_deepseek.model.causal_lm import DeepseekV2ForCausalLM

    return DeepseekV2ForCausalLM.from_pretrained(
        str(base), adapter=None if adapter is None else str(adapter), show_progress=False
    )


def test_peft_made_adapter_loads_with_the_same_logits(ref):
    base_logits = _logits(_load(FIX / "base"), ref["input_ids"])
    assert_close_to_scale(base_logits, ref["logits_base"], **TOL)
    got = _logits(_load(FIX / "base", FIX / "peft_adapter"), ref["input_ids"])
    assert np.abs(ref["logits_peft_adapter"] - ref["logits_base"]).max() > 0.5  # the adapter matters
    assert_close_to_scale(got, ref["logits_peft_adapter"], **TOL)


def test_peft_made_adapter_in_graph_mode(ref):
    import mindspore as ms

    mode = ms.get_context("mode")
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        got = _logits(_load(FIX / "base", FIX / "peft_adapter"), ref["input_ids"])
    finally:
        ms.set_context(mode=mode)
    assert_close_to_scale(got, ref["logits_peft_adapter"], **TOL)


def test_our_exported_adapter_matches_peft_on_transformers(ref):
    model = _load(FIX / "base", FIX / "ours_adapter")
    assert_close_to_scale(_logits(model, ref["input_ids"]), ref["logits_ours_adapter"], **TOL)
    # the routed-expert adapters are part of what PEFT reproduced: without them the logits move
    import mindspore as ms

    for p in model.get_parameters():
        if "lora_B" in p.name and ".mlp.experts." in p.name:
            p.set_data(ms.Tensor(np.zeros(p.shape, np.float32)))
    assert np.abs(_logits(model, ref["input_ids"]) - ref["logits_ours_adapter"]).max() > 0.05


def test_exported_adapter_uses_peft_names_with_experts_unstacked():
    cfg = json.loads((FIX / "ours_adapter" / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 4 and cfg["lora_alpha"] == 8.0
    assert cfg["base_model_name_or_path"] == "tests/fixtures/lora/base"
    names = set(load_file(str(FIX / "ours_adapter" / "adapter_model.safetensors")))
    assert "base_model.model.model.layers.1.mlp.experts.3.down_proj.lora_B.weight" in names
    assert "base_model.model.model.layers.0.self_attn.q_a_proj.lora_A.weight" in names
    assert not any(".mlp.experts.gate_proj." in n for n in names)  # no stacked tensor


def test_merge_streams_an_hf_folder_that_transformers_reads_the_same(ref, tmp_path):
    out = tmp_path / "merged"
    assert main(["export-lora", str(FIX / "ours_adapter"), str(out), "--merge", str(FIX / "base")]) == 0
    assert_close_to_scale(_logits(_load(out), ref["input_ids"]), ref["logits_merged"], **TOL)
    from ms_deepseek.checkpoint.safetensors_io import read_header

    merged, base = (
        read_header(out / "model.safetensors").tensors,
        read_header(FIX / "base" / "model.safetensors").tensors,
    )
    assert merged.keys() == base.keys()
    assert {t.dtype for t in merged.values()} == {"BF16"}  # dtype kept
    raw_m, raw_b = (out / "model.safetensors").read_bytes(), (FIX / "base" / "model.safetensors").read_bytes()

    def data(raw, info):
        return raw[info.offset : info.offset + info.nbytes]

    untouched = "model.layers.1.mlp.shared_experts.up_proj.weight"  # not a target of ours_adapter
    assert data(raw_m, merged[untouched]) == data(raw_b, base[untouched])
    touched = "model.layers.1.mlp.experts.2.up_proj.weight"
    assert data(raw_m, merged[touched]) != data(raw_b, base[touched])
    assert (out / "config.json").read_text() == (FIX / "base" / "config.json").read_text()


# ------------------------------------------------------------------------------ bad input
def _adapter_copy(tmp_path, edit=None, tensors=None):
    out = tmp_path / "adapter"
    shutil.copytree(FIX / "peft_adapter", out)
    if edit is not None:
        cfg = json.loads((out / "adapter_config.json").read_text())
        cfg.update(edit)
        (out / "adapter_config.json").write_text(json.dumps(cfg))
    if tensors is not None:
        data = load_file(str(out / "adapter_model.safetensors"))
        tensors(data)
        save_file(data, str(out / "adapter_model.safetensors"))
    return out


@pytest.mark.parametrize(
    "edit, key",
    [
        ({"use_dora": True}, "use_dora"),
        ({"use_rslora": True}, "use_rslora"),
        ({"peft_type": "IA3"}, "peft_type"),
        ({"bias": "all"}, "bias"),
        ({"layers_to_transform": [0]}, "layers_to_transform"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ],
)
def test_unsupported_peft_options_are_refused_naming_the_key(tmp_path, capsys, edit, key):
    adapter = _adapter_copy(tmp_path, edit=edit)
    code = main(["export-lora", str(adapter), str(tmp_path / "out"), "--merge", str(FIX / "base")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and key in err, err
    assert not (tmp_path / "out").exists()
    with pytest.raises(UserError, match=key):
        _load(FIX / "base", adapter)


def test_adapter_for_another_base_names_the_tensor(tmp_path, capsys):
    from ms_deepseek.checkpoint.convert.synthetic import write_random_checkpoint
    from ms_deepseek.config.model import DeepseekV2Config

    cfg = DeepseekV2Config.from_json(FIX / "base" / "config.json").replace(q_lora_rank=8)
    other = write_random_checkpoint(tmp_path / "other", cfg, dtype="float32")
    with pytest.raises(UserError, match=r"q_a_proj\.lora_B\.weight has shape \[12, 4\], this base needs \[8, 4\]"):
        _load(other, FIX / "peft_adapter")
    code = main(["export-lora", str(FIX / "peft_adapter"), str(tmp_path / "out"), "--merge", str(other)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "q_a_proj" in err, err
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.tmp-*"))


def test_adapter_with_a_missing_expert_names_it(tmp_path):
    adapter = tmp_path / "ours"
    shutil.copytree(FIX / "ours_adapter", adapter)
    data = load_file(str(adapter / "adapter_model.safetensors"))
    del data["base_model.model.model.layers.1.mlp.experts.2.up_proj.lora_A.weight"]
    save_file(data, str(adapter / "adapter_model.safetensors"))
    with pytest.raises(UserError, match=r"experts\.2\.up_proj\.lora_A\.weight is missing"):
        _load(FIX / "base", adapter)


def test_targets_and_ranks_are_checked_against_the_model():
    from ms_deepseek.config.model import DeepseekV2Config
    from ms_deepseek.model import lora
    from ms_deepseek.model.causal_lm import DeepseekV2ForCausalLM

    model = DeepseekV2ForCausalLM(DeepseekV2Config.from_json(FIX / "base" / "config.json"))
    with pytest.raises(
        UserError,
        match=r"lora\.r: 13 is larger than model\.layers\.0\.self_attn\.q_a_proj "
        r"\(12 x 32\)",
    ):
        lora.add_adapters(model, LoraSpec(r=13, alpha=8, target_modules=["q_a_proj"]))
    with pytest.raises(UserError, match=r"lora\.target_modules\[1\]: 'shared_experts\.o_proj' matches no module"):
        lora.add_adapters(model, LoraSpec(r=2, alpha=8, target_modules=["o_proj", "shared_experts.o_proj"]))
    assert not lora.has_adapters(model)  # refused before anything was attached


@pytest.mark.parametrize(
    "lora_section, key",
    [
        ({"r": 0}, "lora.r"),
        ({"alpha": 0}, "lora.alpha"),
        ({"target_modules": ["q_proj", "foo_proj"]}, "lora.target_modules[1]"),
        ({"use_dora": True}, "lora.use_dora"),
        ({"dropout": 1.0}, "lora.dropout"),
    ],
)
def test_recipe_lora_section_refusals(lora_section, key):
    from ms_deepseek.config.recipe import load_recipe_dict

    with pytest.raises(UserError) as info:
        load_recipe_dict({"data": {"embedded_vocab_size": 4096}, "lora": lora_section})
    assert str(info.value).startswith(key), str(info.value)


def test_merge_into_a_stacked_ms_layout_base_gives_the_same_hf_folder(tmp_path):
    """A base converted to our layout (experts stacked) merges into the same HF tensors as the HF base."""
    assert main(["convert", "hf-to-ms", str(FIX / "base"), str(tmp_path / "ms")]) == 0
    assert main(["export-lora", str(FIX / "ours_adapter"), str(tmp_path / "a"), "--merge", str(FIX / "base")]) == 0
    assert main(["export-lora", str(FIX / "ours_adapter"), str(tmp_path / "b"), "--merge", str(tmp_path / "ms")]) == 0
    from ms_deepseek.checkpoint.weight_files import read_weight_files

    def tensors(folder):  # name -> raw bytes (the output mirrors the base's files: one file, or shards + index)
        ckpt = read_weight_files(folder)
        out = {}
        for name, info in ckpt.tensors.items():
            with open(info.file, "rb") as f:
                f.seek(info.offset)
                out[name] = (info.dtype, info.shape, f.read(info.nbytes))
        return out

    a, b = tensors(tmp_path / "a"), tensors(tmp_path / "b")
    assert a.keys() == b.keys() and a == b


def test_export_notes_what_peft_on_transformers_5_ignores(tmp_path, capsys):
    """PEFT 0.21.2 on transformers 5.24 applies gate/up/down_proj only to the fused routed experts
    (checked in the reference env): the export says so for dense-MLP / shared-expert adapters."""
    from ms_deepseek.model.lora_export import compatibility_notes

    names = load_file(str(FIX / "ours_adapter" / "adapter_model.safetensors")).keys()
    assert compatibility_notes(names) == []
    notes = compatibility_notes(
        list(names) + ["base_model.model.model.layers.1.mlp.shared_experts.up_proj.lora_A.weight"]
    )
    assert len(notes) == 1 and "model.layers.*.mlp.shared_experts.up_proj" in notes[0]


def test_export_of_a_full_training_run_or_a_missing_folder_is_one_line(tmp_path, capsys):
    step = tmp_path / "run" / "checkpoints" / "step_00000001"
    step.mkdir(parents=True)
    (step / "state.json").write_text("{}")
    (step / "model.safetensors").write_bytes(b"")
    (step / "recipe.yaml").write_text("model: {source: tiny}\n")
    for src, needle in ((step, "not a LoRA run"), (tmp_path / "nowhere", "no such run")):
        code = main(["export-lora", str(src), str(tmp_path / "out")])
        err = capsys.readouterr().err.strip()
        assert code == 2 and len(err.splitlines()) == 1 and needle in err, err
    assert not (tmp_path / "out").exists()


def test_saved_recipe_round_trips_with_and_without_lora():
    import yaml

    from ms_deepseek.config.recipe import load_recipe_dict

    full = load_recipe_dict({"data": {"embedded_vocab_size": 4096}})
    assert "lora" not in full.to_dict() and load_recipe_dict(yaml.safe_load(full.to_yaml())).lora is None
    with_lora = load_recipe_dict({"data": {"embedded_vocab_size": 4096}, "lora": {"r": 4}})
    assert load_recipe_dict(yaml.safe_load(with_lora.to_yaml())).lora == with_lora.lora
    assert load_recipe_dict({"data": {"embedded_vocab_size": 4096}, "lora": None}).lora.r == 8  # "lora:" = defaults


@pytest.mark.parametrize(
    "layout",
    [
        dict(),
        dict(dp=4, tp=2, ep=4, optimizer_shard=True, sequence_parallel=True),
        dict(dp=2, tp=2, pp=2, ep=2, micro_batches=4),
    ],
)
def test_adapters_shard_with_their_base_layers(layout):
    """The plan gives every adapter parameter the base layer's split and every adapter matmul a strategy
    that consumes it (apply_plan checks the pairs); A keeps the split of ``in``, B of ``out`` / experts."""
    from ms_deepseek.config.model import DeepseekV2Config
    from ms_deepseek.config.parallel import ParallelConfig
    from ms_deepseek.model import lora
    from ms_deepseek.model.causal_lm import DeepseekV2ForCausalLM
    from ms_deepseek.parallel_apply.apply import apply_plan

    cfg = DeepseekV2Config.from_json(FIX / "base" / "config.json")
    model = DeepseekV2ForCausalLM(cfg)
    lora.add_adapters(
        model,
        LoraSpec(
            r=4,
            alpha=8,
            target_modules=[
                "q_a_proj",
                "q_b_proj",
                "kv_a_proj_with_mqa",
                "kv_b_proj",
                "o_proj",
                "gate_proj",
                "up_proj",
                "down_proj",
            ],
        ),
    )
    par = ParallelConfig(**layout)
    applied = apply_plan(model, par, cfg)
    tp, ep = par.tp, par.ep
    lay = applied.param_layouts
    assert lay["model.layers.0.self_attn.kv_b_proj.lora_A.weight"] == (1, 1)  # colwise: in whole
    assert lay["model.layers.0.self_attn.kv_b_proj.lora_B.weight"] == (tp, 1)  # out split as the weight
    assert lay["model.layers.0.self_attn.o_proj.lora_A.weight"] == (1, tp)  # rowwise: in split
    assert lay["model.layers.0.self_attn.o_proj.lora_B.weight"] == (1, 1)
    assert lay["model.layers.1.mlp.experts.gate_proj.lora_B.weight"] == (ep, tp, 1)
    assert lay["model.layers.1.mlp.experts.down_proj.lora_A.weight"] == (ep, 1, tp)
    adapters = [n for n in lay if ".lora_" in n]
    assert len(adapters) == sum(".lora_" in p.name for p in model.get_parameters())
    prims = [p for p in applied.strategies if "lora" in p]
    assert any(p.endswith("experts.gate_lora_b_bmm") for p in prims)
    assert any(p.endswith("o_proj.lora_a_matmul") for p in prims)


def test_a_lone_routed_gate_adapter_is_exported_with_a_zero_up_partner(tmp_path):
    """PEFT on transformers 5 fuses gate/up_proj and refuses half a pair: the export adds B = 0 partners."""
    import yaml

    from ms_deepseek.model.lora_export import checkpoint_adapter

    step = tmp_path / "run" / "checkpoints" / "step_00000001"
    step.mkdir(parents=True)
    shutil.copy(FIX / "base" / "config.json", step / "config.json")
    rng = np.random.default_rng(0)
    save_file(
        {
            "model.layers.1.mlp.experts.gate_proj.lora_A.weight": rng.normal(size=(4, 2, 32)).astype(np.float32),
            "model.layers.1.mlp.experts.gate_proj.lora_B.weight": rng.normal(size=(4, 16, 2)).astype(np.float32),
        },
        str(step / "model.safetensors"),
    )
    (step / "recipe.yaml").write_text(
        yaml.safe_dump({"lora": {"r": 2, "alpha": 4.0, "target_modules": ["experts.gate_proj"]}})
    )
    (step / "state.json").write_text("{}")  # a training checkpoint: what makes recipe.yaml's lora count
    tensors, config = checkpoint_adapter(step, FIX / "base")
    assert config["target_modules"] == ["gate_proj", "up_proj"] and len(tensors) == 16
    up_b = tensors["base_model.model.model.layers.1.mlp.experts.3.up_proj.lora_B.weight"]
    assert up_b.shape == (16, 2) and not up_b.any()
