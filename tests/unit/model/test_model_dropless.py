"""The dropless MoE path (``model.moe_dispatch: dropless``): parity with transformers' DeepseekV2ForCausalLM in
training mode (its MoE is dropless), and equality with the capacity path at a capacity that drops nothing, with
LoRA on the experts and with an int8 / int4 frozen base.

Parity: the committed references (tests/fixtures/make_reference.py) checked on the dropless path as
test_model_parity.py checks the capacity path: logits and loss (2 ulps of their largest value per term of the
hidden size), routing sets per MoE layer, CE-loss gradients (1e-3 of the max), PyNative and graph mode.
"""

import sys

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor

from builders import small_config
from repo_paths import FIXTURES
from tolerances import assert_close_to_scale

sys.path.insert(0, str(FIXTURES))
from load_reference import FIXTURES_DIR, VARIANTS, load_reference, routing  # noqa: E402
from parity import gradient_errors  # noqa: E402

from ms_deepseek import DeepseekV2ForCausalLM  # noqa: E402
from ms_deepseek.config.lora import LoraSpec  # noqa: E402
from ms_deepseek.config.quant import QuantSpec  # noqa: E402
from ms_deepseek.core.errors import UserError  # noqa: E402
from ms_deepseek.model.lora import add_adapters  # noqa: E402
from ms_deepseek.model.quant import quantize_model  # noqa: E402

MODES = {"pynative": ms.PYNATIVE_MODE, "graph": ms.GRAPH_MODE}


def _moe_layers(model):
    return [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "dropless")]


# ----------------------------------------------------------------------------- parity with transformers


@pytest.fixture(scope="module", params=VARIANTS)
def variant(request):
    folder = FIXTURES_DIR / request.param
    model = DeepseekV2ForCausalLM.from_pretrained(folder, show_progress=False, moe_dispatch="dropless")
    model.set_train(True)  # the training path (transformers' reference ran its dropless MoE)
    model.output_routing = True
    assert all(moe.dropless and moe.training for moe in _moe_layers(model))
    return request.param, model, load_reference(folder)


@pytest.mark.parametrize("mode", list(MODES))
def test_dropless_logits_loss_routing(variant, mode):
    name, model, ref = variant
    ms.set_context(mode=MODES[mode])
    out = model(Tensor(ref["input_ids"].astype(np.int32)), Tensor(ref["labels"].astype(np.int32)))
    cfg = model.config
    assert_close_to_scale(
        out.logits.asnumpy(), ref["logits"], ulps=2, terms=cfg.hidden_size, err_msg=f"{name}/{mode}: logits"
    )
    assert_close_to_scale(
        out.loss.asnumpy(), ref["loss"], ulps=2, terms=cfg.hidden_size, err_msg=f"{name}/{mode}: loss"
    )
    for slot, layer in enumerate(cfg.moe_layer_indices):
        idx = out.routing[slot][1].asnumpy()
        ref_idx = routing(ref, layer)[1]
        np.testing.assert_array_equal(
            np.sort(idx, 1), np.sort(ref_idx, 1), err_msg=f"{name}/{mode} layer {layer}: selected expert sets differ"
        )
    stats = out.moe_stats.asnumpy() if hasattr(out, "moe_stats") else None
    if stats is not None:
        assert not stats.reshape(len(cfg.moe_layer_indices), -1)[:, cfg.n_routed_experts].any()  # nothing dropped


@pytest.mark.parametrize("mode", list(MODES))
def test_dropless_gradients(variant, mode):
    name, model, ref = variant
    errors = gradient_errors(model, ref, mode)
    worst = max(errors, key=errors.get)
    assert errors[worst] <= 1e-3, f"{name}/{mode}: grad {worst} error {errors[worst]:.3g} of its max"


# ----------------------------------------------------------------------------- dropless == capacity


def _pair(quant_bits=None, lora=False, **over):
    """The same random model twice: capacity (a factor that drops nothing) and dropless; optional int base, LoRA."""
    models = []
    for dispatch in ("capacity", "dropless"):
        ms.set_seed(7)
        np.random.seed(7)
        values = {"capacity_factor": 1e6, **over, "moe_dispatch": dispatch}
        model = DeepseekV2ForCausalLM(small_config(**values))
        if quant_bits:
            quantize_model(model, QuantSpec(bits=quant_bits, group_size=8 if quant_bits == 4 else None))
        if lora:
            add_adapters(
                model,
                LoraSpec(
                    r=4,
                    alpha=8,
                    dropout=0.0,
                    target_modules=["experts.gate_proj", "experts.up_proj", "experts.down_proj"],
                ),
                seed=3,
            )
            for p in model.trainable_params():  # B starts at zero: give it values so the adapter counts
                if ".lora_B." in p.name:
                    p.set_data(Tensor(np.random.default_rng(len(p.name)).normal(0, 0.05, p.shape).astype(np.float32)))
        model.set_train(True)
        models.append(model)
    capacity, dropless = models
    ms.load_param_into_net(dropless, capacity.parameters_dict())  # identical weights, whatever the init order
    return capacity, dropless


def _loss_and_grads(model, ids, mode):
    ms.set_context(mode=MODES[mode])
    weights = model.trainable_params()

    def loss_fn(x):
        return model(x, x)[1]

    fn = ms.value_and_grad(loss_fn, None, weights)
    loss, grads = (ms.jit(fn) if mode == "graph" else fn)(ids)
    return float(loss.asnumpy()), {p.name: g.asnumpy() for p, g in zip(weights, grads)}


@pytest.mark.parametrize(
    "case",
    [
        pytest.param({}, id="plain-graph"),
        pytest.param({"mode": "pynative"}, id="plain-pynative"),
        pytest.param({"lora": True, "mode": "pynative"}, id="lora-experts"),
        pytest.param({"lora": True, "quant_bits": 8, "mode": "pynative"}, id="int8-base-lora"),
        pytest.param({"lora": True, "quant_bits": 4, "mode": "pynative"}, id="int4-base-lora"),
    ],
)
def test_dropless_equals_capacity_that_drops_nothing(case):
    case = dict(case)
    mode = case.pop("mode", "graph")
    capacity, dropless = _pair(**case)
    ids = Tensor(np.random.default_rng(0).integers(0, capacity.config.vocab_size, (2, 24)).astype(np.int32))
    ms.set_context(mode=ms.PYNATIVE_MODE)  # the forward once; the mode under test runs the gradients
    out_c, out_d = capacity(ids, ids), dropless(ids, ids)
    hidden = capacity.config.hidden_size
    assert_close_to_scale(out_d.logits.asnumpy(), out_c.logits.asnumpy(), ulps=2, terms=hidden, err_msg="logits")
    loss_c, grads_c = _loss_and_grads(capacity, ids, mode)
    loss_d, grads_d = _loss_and_grads(dropless, ids, mode)
    assert abs(loss_d - loss_c) <= 2 * hidden * np.finfo(np.float32).eps * abs(loss_c)
    assert grads_c.keys() == grads_d.keys()
    expert_grads = [n for n in grads_c if ".experts." in n]
    assert expert_grads and (not case.get("lora") or any(".lora_A." in n for n in expert_grads))
    for name in grads_c:
        scale = max(float(np.abs(grads_c[name]).max()), 1e-30)
        err = float(np.abs(grads_d[name] - grads_c[name]).max()) / scale
        assert err <= 1e-4, f"{name}: dropless gradient differs from capacity's by {err:.3g} of its max"


def test_capacity_drops_and_dropless_does_not():
    """At capacity factor 0.5 the capacity path drops choices (its stats say so); the dropless path, same weights,
    drops none and so differs from it."""
    capacity, dropless = _pair(capacity_factor=0.5)
    ids = Tensor(np.random.default_rng(1).integers(0, capacity.config.vocab_size, (2, 24)).astype(np.int32))
    ms.set_context(mode=ms.PYNATIVE_MODE)
    E = capacity.config.n_routed_experts
    dropped = capacity(ids, ids).moe_stats.asnumpy().reshape(-1, E + 4)[:, E]
    assert (dropped > 0).all()
    assert not dropless(ids, ids).moe_stats.asnumpy().reshape(-1, E + 4)[:, E].any()
    assert np.abs(dropless(ids, ids).logits.asnumpy() - capacity(ids, ids).logits.asnumpy()).max() > 1e-3


# ----------------------------------------------------------------------------- decoding


@pytest.mark.parametrize("mode", list(MODES))
def test_generate_dropless_equals_capacity(mode):
    """At the same weights a dropless model generates what the capacity model does (the reference's greedy ids);
    its decode steps take the path ``DeepseekV2MoE.set_decode_mode`` chose for the mode (graph: the dropless
    kernel, PyNative: the one-token gather), the capacity model's always the one-token gather."""
    from ms_deepseek.generate import generate

    folder = FIXTURES_DIR / "lite"
    ref = load_reference(folder)["generate"]
    ids = {}
    ms.set_context(mode=MODES[mode])
    try:
        for dispatch in ("capacity", "dropless"):
            model = DeepseekV2ForCausalLM.from_pretrained(folder, show_progress=False, moe_dispatch=dispatch)
            ids[dispatch] = generate(model, ref["prompt"], ref["max_new_tokens"], eos_ids=()).ids
            one_token = [moe.one_token_decode for moe in _moe_layers(model)]
            assert one_token == [dispatch == "capacity" or mode == "pynative"] * len(one_token), (dispatch, one_token)
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)
    assert ids["dropless"] == ids["capacity"] == ref["greedy"], ids


# ----------------------------------------------------------------------------- the key


def test_config_refuses_an_unknown_dispatch_naming_the_key():
    with pytest.raises(UserError, match=r"^config moe_dispatch: must be one of capacity, dropless, got 'drop'$"):
        small_config(moe_dispatch="drop")


def test_split_experts_without_the_exchange_are_refused_by_the_layer():
    model = DeepseekV2ForCausalLM(small_config(moe_dispatch="dropless"))
    layer = _moe_layers(model)[0]
    layer.set_expert_placement(np.zeros((8, 2), np.int32), groups=2, ep=1)  # plain data parallel: groups do not matter
    with pytest.raises(UserError, match=r"^model.moe_dispatch: dropless splits the experts 2 ways only on the bounded"):
        layer.set_expert_placement(np.zeros((8, 2), np.int32), groups=2, ep=2)


# ----------------------------------------------------------------------------- sharded: the bounded exchange


def _bounded_pair(**over):
    """The same random dropless model twice: the sorted path, and the bounded exchange at groups 2, ep 2 (its
    sharded form, run here on one device: the groups and the exchange view are reshapes of the same tokens)."""
    from ms_deepseek.model.moe import default_placement

    models = []
    for bounded in (False, True):
        ms.set_seed(7)
        model = DeepseekV2ForCausalLM(small_config(moe_dispatch="dropless", **over))
        if bounded:
            for layer in _moe_layers(model):
                layer.use_bounded_exchange()
                layer.set_expert_placement(default_placement(8, 2), groups=2, ep=2)
        model.set_train(True)
        models.append(model)
    ms.load_param_into_net(models[1], models[0].parameters_dict())
    return models


def test_bounded_exchange_equals_the_sorted_path_and_drops_nothing():
    """Under a parallel plan a dropless layer runs the capacity path's exchange at C = N per group, which holds
    every choice: loss and gradients equal the sorted path's, nothing dropped, whatever capacity_factor says."""
    sorted_path, bounded = _bounded_pair(capacity_factor=0.5)  # a factor the dropless layer must not read
    ids = Tensor(np.random.default_rng(1).integers(0, sorted_path.config.vocab_size, (2, 24)).astype(np.int32))
    E = sorted_path.config.n_routed_experts
    ms.set_context(mode=ms.PYNATIVE_MODE)
    assert not bounded(ids, ids).moe_stats.asnumpy().reshape(-1, E + 4)[:, E].any()
    loss_s, grads_s = _loss_and_grads(sorted_path, ids, "pynative")
    loss_b, grads_b = _loss_and_grads(bounded, ids, "pynative")
    hidden = sorted_path.config.hidden_size
    assert abs(loss_b - loss_s) <= 2 * hidden * np.finfo(np.float32).eps * abs(loss_s)
    assert grads_s.keys() == grads_b.keys() and any(".experts." in n for n in grads_s)
    for name in grads_s:
        scale = max(float(np.abs(grads_s[name]).max()), 1e-30)
        err = float(np.abs(grads_b[name] - grads_s[name]).max()) / scale
        assert err <= 1e-4, f"{name}: the bounded exchange's gradient differs from the sorted path's by {err:.3g}"


def test_plan_takes_the_bounded_exchange_only_under_semi_auto():
    """apply_plan: with ep the sorted path's primitives are gone (none is left without a strategy); on one device
    the layer keeps them (no strategy needed outside SEMI_AUTO_PARALLEL) and runs the sorted path."""
    from ms_deepseek.config.parallel import ParallelConfig
    from ms_deepseek.parallel_apply.apply import apply_plan

    cfg = small_config(moe_dispatch="dropless")
    sharded = DeepseekV2ForCausalLM(cfg)
    applied = apply_plan(sharded, ParallelConfig(dp=2, ep=2), cfg)
    for layer in _moe_layers(sharded):
        assert layer.bounded_exchange and layer.sorted_path_members() == ()
        assert not hasattr(layer, "choice_sort") and layer.experts.gmm is None
    assert any(p.endswith(".mlp.slot_sort") for p in applied.strategies)
    one = DeepseekV2ForCausalLM(cfg)
    apply_plan(one, ParallelConfig(), cfg)
    assert all(not layer.bounded_exchange and hasattr(layer, "choice_sort") for layer in _moe_layers(one))


def test_recipe_key_model_moe_dispatch():
    from ms_deepseek.config.recipe import load_recipe_dict

    recipe = load_recipe_dict({"model": {"source": "tiny", "moe_dispatch": "dropless"}})
    assert recipe.model_config.moe_dispatch == "dropless"
    assert load_recipe_dict({"model": {"source": "tiny"}}).model_config.moe_dispatch == "capacity"
    with pytest.raises(UserError, match=r"^model.moe_dispatch: must be one of capacity, dropless, got 'sparse'$"):
        load_recipe_dict({"model": {"source": "tiny", "moe_dispatch": "sparse"}})
    sharded = load_recipe_dict(
        {
            "model": {"source": "tiny", "moe_dispatch": "dropless"},
            "parallel": {"dp": 2, "ep": 2},
            "train": {"micro_batch_size": 2},
        }
    )
    assert sharded.parallel.uses_semi_auto and sharded.model_config.moe_dispatch == "dropless"
