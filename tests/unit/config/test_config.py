"""Model config: both config.json formats, release-format output, validation, presets, parameter counts."""

import json

import pytest

from ms_deepseek.config.inventory import count_parameters
from ms_deepseek.config.model import PRESET_NAMES, DeepseekV2Config, get_preset, load_model_config
from ms_deepseek.core.errors import UserError
from ms_deepseek.model.rope import softmax_scale


def test_presets_give_published_parameter_counts():
    v2 = count_parameters(get_preset("deepseek-v2"))
    assert 234e9 < v2.total < 237e9 and 20e9 < v2.activated < 22e9
    lite = count_parameters(get_preset("deepseek-v2-lite"))
    assert 15.5e9 < lite.total < 16e9 and 2.3e9 < lite.activated < 2.5e9
    assert count_parameters(get_preset("deepseek-v2-chat")).total == v2.total
    tiny = count_parameters(get_preset("tiny"))
    assert 1e6 < tiny.total < 10e6
    assert set(PRESET_NAMES) >= {"deepseek-v2", "deepseek-v2-chat", "deepseek-v2-lite", "tiny"}


def test_parameter_count_matches_instantiated_model():
    from ms_deepseek import DeepseekV2ForCausalLM

    cfg = get_preset(
        "tiny",
        vocab_size=300,
        hidden_size=48,
        num_hidden_layers=3,
        moe_layer_freq=2,
        first_k_dense_replace=1,
        attention_bias=True,
    )
    model = DeepseekV2ForCausalLM(cfg)
    counted = sum(p.size for p in model.trainable_params())
    assert counted == count_parameters(cfg).total


def test_release_and_transformers5_formats_agree(tmp_path):
    release = get_preset("deepseek-v2").to_hf_dict()
    assert release["rope_scaling"]["type"] == "yarn" and "rope_parameters" not in release
    t5 = dict(release)
    scaling = dict(t5.pop("rope_scaling"))
    scaling["rope_type"] = scaling.pop("type")
    scaling["rope_theta"] = t5.pop("rope_theta")
    t5["rope_parameters"] = scaling
    a = DeepseekV2Config.from_dict(release)
    b = DeepseekV2Config.from_dict(t5)
    assert a == b == get_preset("deepseek-v2")
    path = tmp_path / "config.json"
    b.save(path)
    assert json.loads(path.read_text())["rope_scaling"]["type"] == "yarn"
    assert DeepseekV2Config.from_json(path) == a


def test_yarn_softmax_scale_uses_mscale_all_dim_squared():
    cfg = get_preset("deepseek-v2")
    mscale = 0.1 * 0.707 * __import__("math").log(40) + 1.0
    assert softmax_scale(cfg) == pytest.approx(192**-0.5 * mscale**2)
    assert softmax_scale(cfg.replace(rope_scaling=None)) == pytest.approx(192**-0.5)


@pytest.mark.parametrize(
    "change, field",
    [
        ({"hidden_size": 0}, "hidden_size"),
        ({"qk_rope_head_dim": 7}, "qk_rope_head_dim"),
        ({"topk_method": "sinkhorn"}, "topk_method"),
        ({"n_group": 7}, "n_group"),
        ({"topk_group": 9}, "topk_group"),
        ({"num_experts_per_tok": 200}, "num_experts_per_tok"),
        ({"first_k_dense_replace": 99}, "first_k_dense_replace"),
        ({"rope_scaling": {"type": "linear", "factor": 2}}, "rope_scaling.type"),
        ({"rope_scaling": {"type": "yarn"}}, "rope_scaling.factor"),
        ({"compute_dtype": "float8"}, "compute_dtype"),
        ({"capacity_factor": -1.0}, "capacity_factor"),
        ({"hidden_size": "big"}, "hidden_size"),
        ({"hidden_sise": 12}, "hidden_sise"),
    ],
)
def test_impossible_values_name_the_field(change, field):
    data = get_preset("deepseek-v2").to_hf_dict()
    data.update(change)
    with pytest.raises(UserError) as err:
        DeepseekV2Config.from_dict(data)
    assert field in str(err.value)


def test_malformed_config_json_names_the_file(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(UserError, match="config.json"):
        DeepseekV2Config.from_json(bad)
    bad.write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(UserError, match="model_type"):
        DeepseekV2Config.from_json(bad)
    with pytest.raises(UserError, match="no such file"):
        DeepseekV2Config.from_json(tmp_path / "missing.json")


def test_load_model_config_accepts_preset_file_and_folder(tmp_path):
    assert load_model_config("tiny") == get_preset("tiny").replace()
    cfg = get_preset("deepseek-v2-lite")
    cfg.save(tmp_path / "config.json")
    assert load_model_config(tmp_path / "config.json") == cfg.replace(capacity_factor=None)
    assert load_model_config(tmp_path) == load_model_config(tmp_path / "config.json")
    with pytest.raises(UserError, match="not a preset"):
        load_model_config("deepseek-v9")
    with pytest.raises(UserError, match="no config.json"):
        load_model_config(tmp_path / "..")


def test_written_keys_survive_a_load(tmp_path):
    """initializer_range and hidden_act are written to config.json, so loading must keep them
    (they used to be dropped: a 0.006 init came back as 0.02, a gelu config loaded as silu)."""
    cfg = get_preset("tiny").replace(initializer_range=0.006)
    path = tmp_path / "config.json"
    cfg.save(path)
    assert json.loads(path.read_text())["initializer_range"] == 0.006
    assert load_model_config(path).initializer_range == 0.006
    data = json.loads(path.read_text())
    data["hidden_act"] = "gelu"
    path.write_text(json.dumps(data))
    with pytest.raises(UserError, match="hidden_act"):
        load_model_config(path)
