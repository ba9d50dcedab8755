"""Parity of the MindSpore port with HuggingFace transformers' DeepseekV2ForCausalLM.

The references were produced by tests/fixtures/make_reference.py (torch 2.13.0,
transformers 5.24.0, float32) and committed; see tests/fixtures/README.md.
Each variant is checked in PyNative and in graph mode: logits, loss and router scores
(2 ulps of their largest value per term of the hidden size, the longest reduction),
routing sets and weights per MoE layer, CE-loss gradients (1e-3 of the max), and the
original code's aux loss, sequence-level and token-level.
"""

import sys

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor

from repo_paths import FIXTURES
from tolerances import assert_close_to_scale

sys.path.insert(0, str(FIXTURES))
from load_reference import FIXTURES_DIR, VARIANTS, load_reference, routing  # noqa: E402
from parity import gradient_errors  # noqa: E402

from ms_deepseek import DeepseekV2ForCausalLM  # noqa: E402

MODES = {"pynative": ms.PYNATIVE_MODE, "graph": ms.GRAPH_MODE}


@pytest.fixture(scope="module", params=VARIANTS)
def variant(request):
    folder = FIXTURES_DIR / request.param
    model = DeepseekV2ForCausalLM.from_pretrained(folder, show_progress=False)
    model.output_routing = True
    return request.param, model, load_reference(folder)


def _forward(model, ref, mode):
    ms.set_context(mode=MODES[mode])
    ids = Tensor(ref["input_ids"].astype(np.int32))
    labels = Tensor(ref["labels"].astype(np.int32))
    return model(ids, labels)


@pytest.mark.parametrize("mode", list(MODES))
def test_logits_loss_routing_aux(variant, mode):
    name, model, ref = variant
    out = _forward(model, ref, mode)
    logits = out.logits.asnumpy()
    assert logits.dtype == np.float32 and logits.shape == ref["logits"].shape
    cfg = model.config
    assert_close_to_scale(logits, ref["logits"], ulps=2, terms=cfg.hidden_size, err_msg=f"{name}/{mode}: logits")
    assert_close_to_scale(
        out.loss.asnumpy(), ref["loss"], ulps=2, terms=cfg.hidden_size, err_msg=f"{name}/{mode}: loss"
    )
    for slot, layer in enumerate(cfg.moe_layer_indices):
        scores, idx, weight = (t.asnumpy() for t in out.routing[slot])
        ref_scores, ref_idx, ref_weight = routing(ref, layer)
        assert_close_to_scale(
            scores, ref_scores, ulps=2, terms=cfg.hidden_size, err_msg=f"{name}/{mode} layer {layer} scores"
        )
        order, ref_order = np.argsort(idx, 1), np.argsort(ref_idx, 1)
        np.testing.assert_array_equal(
            np.take_along_axis(idx, order, 1),
            np.take_along_axis(ref_idx, ref_order, 1),
            err_msg=f"{name}/{mode} layer {layer}: selected expert sets differ",
        )
        np.testing.assert_allclose(
            np.take_along_axis(weight, order, 1),
            np.take_along_axis(ref_weight, ref_order, 1),
            rtol=1e-4,
            atol=1e-5,
            err_msg=f"{name}/{mode} layer {layer}: routing weights",
        )
    ref_aux = sum(ref["summary"]["aux"][str(i)]["seq"] for i in cfg.moe_layer_indices)
    assert abs(float(out.aux_loss.asnumpy()) - ref_aux) <= 1e-6 + 1e-4 * abs(ref_aux)


def test_token_level_aux_loss(variant):
    name, model, ref = variant
    cfg = model.config
    ms.set_context(mode=ms.PYNATIVE_MODE)
    for cell in model.cells_and_names():
        if hasattr(cell[1], "seq_aux"):
            cell[1].seq_aux = False
    try:
        out = model(Tensor(ref["input_ids"].astype(np.int32)))
    finally:
        for cell in model.cells_and_names():
            if hasattr(cell[1], "seq_aux"):
                cell[1].seq_aux = cfg.seq_aux
    ref_aux = sum(ref["summary"]["aux"][str(i)]["token"] for i in cfg.moe_layer_indices)
    assert abs(float(out.aux_loss.asnumpy()) - ref_aux) <= 1e-6 + 1e-4 * abs(ref_aux)


@pytest.mark.parametrize("mode", list(MODES))
def test_gradients(variant, mode):
    name, model, ref = variant
    errors = gradient_errors(model, ref, mode)
    worst = max(errors, key=errors.get)
    assert errors[worst] <= 1e-3, f"{name}/{mode}: grad {worst} error {errors[worst]:.3g} of its max"
