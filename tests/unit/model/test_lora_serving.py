"""The shipped LoRA recipes' adapters serve under transformers + PEFT as they were trained.

Measured in the reference env (tests/fixtures/make_lora_reference.py, transformers 5.24 + PEFT
0.21.2): ``ours_adapter`` was trained with the targets of recipes/tiny-lora-cpu.yaml and
``shared_adapter`` with every kind of target (the dense MLP and the shared experts too); for each,
``logits_<name>`` are PEFT's logits and ``reference.json`` lists the modules PEFT put a LoRA
layer on. PEFT on transformers 5 maps every ``gate/up/down_proj`` target to the fused routed
experts and adapts no dense MLP or shared expert, so a recipe may target only what it wraps.
"""

import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from safetensors.numpy import load_file

from ms_deepseek.config.lora import LoraSpec, lora_inventory
from ms_deepseek.config.model import DeepseekV2Config

from repo_paths import FIXTURES, REPO
from tolerances import assert_close_to_scale

FIX = FIXTURES / "lora"
# logits computed two ways (another framework, another order of the float32 reductions): 2 ulps of the
# largest logit per term of the longest reduction, the hidden size
TOL = dict(ulps=2, terms=json.loads((FIX / "base" / "config.json").read_text())["hidden_size"])
SHIPPED = sorted((REPO / "recipes").glob("*lora*.yaml"))


@pytest.fixture(scope="module")
def ref():
    return load_file(str(FIX / "reference.safetensors"))


@pytest.fixture(scope="module")
def meta():
    return json.loads((FIX / "reference.json").read_text())


def _targets(recipe: Path):
    return list(yaml.safe_load(recipe.read_text())["lora"]["target_modules"])


def _adapted_modules(targets):
    """HF module paths of the fixture model the targets adapt (the routed-expert stack as PEFT's
    fused ``mlp.experts`` module)."""
    cfg = DeepseekV2Config.from_json(FIX / "base" / "config.json")
    names = [
        i.name[: -len(".lora_A.weight")]
        for i in lora_inventory(cfg, LoraSpec(r=2, target_modules=targets))
        if i.name.endswith(".lora_A.weight")
    ]
    return sorted({n.rsplit(".", 1)[0] if ".mlp.experts." in n else n for n in names})


def _logits(adapter, zero=lambda name: False):
    import mindspore as ms

    from ms_deepseek.model.causal_lm import DeepseekV2ForCausalLM

    model = DeepseekV2ForCausalLM.from_pretrained(str(FIX / "base"), adapter=str(FIX / adapter), show_progress=False)
    for p in model.get_parameters():
        if "lora_B" in p.name and zero(p.name):
            p.set_data(ms.Tensor(np.zeros(p.shape, np.float32)))
    model.set_train(False)
    ids = load_file(str(FIX / "reference.safetensors"))["input_ids"]
    return model(ms.Tensor(ids)).logits.asnumpy()


@pytest.mark.parametrize("recipe", SHIPPED, ids=lambda p: p.stem)
def test_shipped_lora_recipes_target_only_what_peft_applies(recipe, meta):
    wrapped = set(meta["shared_adapter"]["wrapped_modules"])  # PEFT asked for every kind of target
    dropped = [m for m in _adapted_modules(_targets(recipe)) if m not in wrapped]
    assert not dropped, f"{recipe.name}: transformers + PEFT would not apply the adapters on {dropped}"


def test_the_cpu_recipes_adapter_gives_the_same_logits_under_peft(ref, meta):
    """The fixture adapter has the shipped CPU recipe's targets; ms-deepseek and PEFT on transformers
    agree on its logits (max abs difference measured: 1.4e-6)."""
    adapter = load_file(str(FIX / "ours_adapter" / "adapter_model.safetensors"))
    modules = sorted({n[len("base_model.model.") :].split(".lora_")[0] for n in adapter})
    modules = sorted({".".join(m.split(".")[:5]) if ".mlp.experts." in m else m for m in modules})
    assert modules == _adapted_modules(_targets(REPO / "recipes" / "tiny-lora-cpu.yaml")), (
        "tests/fixtures/lora/ours_adapter was not made with recipes/tiny-lora-cpu.yaml's targets: regenerate it"
    )
    got = _logits("ours_adapter")
    assert np.abs(got - ref["logits_base"]).max() > 0.5  # the adapter matters
    assert_close_to_scale(got, ref["logits_ours_adapter"], **TOL)


def test_peft_drops_the_dense_mlp_and_shared_expert_adapters(ref):
    """With dense-MLP and shared-expert targets PEFT's logits are ours without those adapters (measured:
    1.84 max abs apart with them, 1.2e-6 without): what the recipes no longer target, and what only
    ``export-lora --merge`` keeps."""
    dense_or_shared = lambda name: ".mlp." in name and ".mlp.experts." not in name  # noqa: E731
    full = _logits("shared_adapter")
    assert np.abs(full - ref["logits_shared_adapter"]).max() > 0.1
    assert_close_to_scale(_logits("shared_adapter", dense_or_shared), ref["logits_shared_adapter"], **TOL)
