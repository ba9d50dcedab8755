"""Converted checkpoints in the model: HF -> ms_deepseek -> ``from_pretrained`` reproduces the transformers
reference logits; a training checkpoint written from the model (``save_checkpoint(model)``, which also holds
the non-weight ``expert_placement`` tables) converts back to the original HuggingFace bytes."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import safetensors

VARIANTS = ("lite", "v2", "lite_yarn", "v2_yarn", "yarn_mscale")

import mindspore as ms  # noqa: E402

from ms_deepseek.checkpoint.convert.hf import hf_to_ms, ms_to_hf  # noqa: E402
from ms_deepseek.model.causal_lm import DeepseekV2ForCausalLM  # noqa: E402

from repo_paths import FIXTURES
from tolerances import assert_close_to_scale

sys.path.insert(0, str(FIXTURES))
from load_reference import load_reference  # noqa: E402


def raw_tensors(folder: Path) -> dict:
    index = folder / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    )
    out = {}
    for fname in files:
        for name, t in safetensors.deserialize((folder / fname).read_bytes()):
            out[name] = (t["dtype"], tuple(t["shape"]), bytes(t["data"]))
    return out


@pytest.fixture(scope="module", params=VARIANTS)
def converted(request, tmp_path_factory):
    src = FIXTURES / request.param
    assert (src / "reference.safetensors").is_file(), f"committed fixture {src} is missing its reference outputs"
    dst = tmp_path_factory.mktemp(request.param) / "ms"
    hf_to_ms(src, dst, shard_size="250KB", progress=False)
    ms.set_context(mode=ms.PYNATIVE_MODE)
    model = DeepseekV2ForCausalLM.from_pretrained(dst, show_progress=False)
    return request.param, src, dst, model


def test_converted_checkpoint_gives_reference_logits(converted):
    name, src, dst, model = converted
    assert len(list(dst.glob("model-*.safetensors"))) > 1
    ref = load_reference(src)
    ms.set_context(mode=ms.PYNATIVE_MODE)
    logits = model(ms.Tensor(ref["input_ids"].astype(np.int32))).logits.asnumpy()
    assert logits.shape == ref["logits"].shape
    assert_close_to_scale(logits, ref["logits"], ulps=2, terms=model.config.hidden_size, err_msg=f"{name}: logits")


def test_trainer_checkpoint_converts_back_to_the_original_bytes(converted, tmp_path):
    name, src, _, model = converted
    step = tmp_path / "run" / "checkpoints" / "step_00000100"
    step.mkdir(parents=True)
    ms.save_checkpoint(model, str(step / "model.safetensors"), format="safetensors")
    ms.save_checkpoint(
        [{"name": "adam_m.model.norm.weight", "data": ms.Tensor(np.zeros(3, np.float32))}],
        str(step / "optimizer.safetensors"),
        format="safetensors",
    )
    model.config.save(step / "config.json", dtype="float32")
    (step / "state.json").write_text('{"step": 100}\n')
    (step / "recipe.yaml").write_text("model: {}\n")
    with safetensors.safe_open(str(step / "model.safetensors"), framework="numpy") as f:
        assert any(k.endswith("expert_placement") for k in f.keys())  # dropped by ms-to-hf
    ms_to_hf(step, tmp_path / "hf", shard_size="300KB", progress=False)
    assert raw_tensors(tmp_path / "hf") == raw_tensors(src), name
