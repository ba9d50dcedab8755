"""Quantized frozen layers (model/quant.py): the CPU reference is dequantise-then-matmul bit for bit,
gradients reach x and the adapters, never the quantized weights; a quantized checkpoint loads."""

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, ops

from ms_deepseek.checkpoint.convert.quant_format import dequantize_array, stored_array
from ms_deepseek.config.quant import QuantSpec
from ms_deepseek.model.layers import Linear
from ms_deepseek.model.quant import QuantLinear, QuantStackedWeight, quantize_model

SMALL = dict(
    vocab_size=512,
    hidden_size=32,
    intermediate_size=64,
    moe_intermediate_size=16,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
    kv_lora_rank=16,
    q_lora_rank=24,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=8,
    max_position_embeddings=64,
    capacity_factor=None,
    n_group=1,
    topk_group=1,
    topk_method="greedy",
)


@pytest.fixture(autouse=True)
def pynative():
    ms.set_context(mode=ms.PYNATIVE_MODE)


@pytest.mark.parametrize("bits,group", [(8, None), (4, None), (4, 16), (8, 8)])
def test_cpu_quantized_linear_equals_explicit_dequantise_then_matmul_bit_for_bit(bits, group):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((40, 32)).astype(np.float32) * 0.1
    x = rng.standard_normal((3, 5, 32)).astype(np.float32)
    spec = QuantSpec(bits=bits, group_size=group)
    stored, scale = stored_array(w, spec)
    layer = QuantLinear(32, 40, spec)
    layer.set_quantized(stored, scale)
    dense = Linear(32, 40)
    dense.weight.set_data(Tensor(dequantize_array(stored, scale, bits)))  # the explicit dequantised weight
    got = layer(Tensor(x)).asnumpy()
    np.testing.assert_array_equal(got, dense(Tensor(x)).asnumpy())
    # and it is a quantization of w: close to the float layer, not equal
    dense.weight.set_data(Tensor(w))
    ref = dense(Tensor(x)).asnumpy()
    assert 0 < np.abs(got - ref).max() < (0.2 if bits == 4 else 0.02) * np.abs(ref).max()


def test_stacked_experts_dequantise_per_expert():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((3, 8, 16)).astype(np.float32)
    spec = QuantSpec(bits=4, group_size=8)
    stored, scale = stored_array(w, spec)
    cell = QuantStackedWeight((3, 8, 16), spec)
    cell.set_quantized(stored, scale)
    assert tuple(cell.weight.shape) == (3, 8, 8) and tuple(cell.weight_scale.shape) == (3, 8, 2)
    np.testing.assert_array_equal(cell.dequantized().asnumpy(), dequantize_array(stored, scale, 4))


def test_gradients_reach_x_and_the_adapter_never_the_quantized_weights():
    from ms_deepseek.model.lora import attach

    rng = np.random.default_rng(2)
    spec = QuantSpec(bits=4, group_size=16)
    layer = QuantLinear(32, 24, spec)
    layer.set_quantized(*stored_array(rng.standard_normal((24, 32)).astype(np.float32), spec))
    attach(
        layer,
        2.0,
        0.0,
        rng.standard_normal((4, 32)).astype(np.float32) * 0.1,
        rng.standard_normal((24, 4)).astype(np.float32) * 0.1,
        "layer",
    )
    trainable = layer.trainable_params()
    assert [p.name for p in trainable] == ["layer.lora_A.weight", "layer.lora_B.weight"]
    assert not any(p.requires_grad for p in (layer.weight, layer.weight_scale, layer.weight_offset))
    x = Tensor(rng.standard_normal((6, 32)).astype(np.float32))
    grad_fn = ops.GradOperation(get_all=True, get_by_list=True)(lambda t: (layer(t) ** 2).sum(), trainable)
    (gx,), (ga, gb) = grad_fn(x)
    assert np.abs(gx.asnumpy()).sum() > 0 and np.abs(ga.asnumpy()).sum() > 0 and np.abs(gb.asnumpy()).sum() > 0


def test_quantize_model_swaps_the_base_layers_and_keeps_embeddings_norms_routers_and_head():
    from ms_deepseek.config.model import get_preset
    from ms_deepseek.model.causal_lm import DeepseekV2ForCausalLM

    model = DeepseekV2ForCausalLM(get_preset("tiny", **SMALL))
    model.set_train(False)
    ids = Tensor(np.arange(20, dtype=np.int32).reshape(2, 10))
    before = model(ids).logits.asnumpy()
    n = quantize_model(model, QuantSpec(bits=8))
    params = {p.name: p for p in model.get_parameters()}
    assert n > 10
    assert params["model.layers.1.mlp.experts.gate_proj.weight"].dtype == ms.int8
    assert params["model.layers.0.self_attn.q_a_proj.weight"].dtype == ms.int8
    for name in (
        "lm_head.weight",
        "model.embed_tokens.weight",
        "model.layers.1.mlp.gate.weight",
        "model.layers.0.input_layernorm.weight",
    ):
        assert params[name].dtype == ms.float32, name
    after = model(ids).logits.asnumpy()
    rel = np.abs(after - before).max() / np.abs(before).max()
    assert 0 < rel < 0.05, rel


@pytest.mark.parametrize("group", [None, 8])
def test_quantized_weights_and_scales_shard_by_the_same_plan(group):
    """apply_plan covers every quantized parameter: the scales split like the weight's output (and expert)
    axis, and the dequantisation Mul keeps the weight's split of ``in``."""
    from ms_deepseek.config.model import get_preset
    from ms_deepseek.config.parallel import ParallelConfig
    from ms_deepseek.model.causal_lm import DeepseekV2ForCausalLM
    from ms_deepseek.parallel_apply.apply import apply_plan

    cfg = get_preset("tiny", **SMALL)
    model = DeepseekV2ForCausalLM(cfg)
    quantize_model(model, QuantSpec(bits=4, group_size=group))
    applied = apply_plan(model, ParallelConfig(dp=4, tp=2, ep=4), cfg)
    lay, strat = applied.param_layouts, applied.strategies
    mul = "dequant_mul" if group is None else "group_dequant_mul"
    assert lay["model.layers.0.self_attn.o_proj.weight"] == (1, 2)  # rowwise: in split, packed int4 too
    # rowwise: a per-channel scale [out, 1] is whole on its one group; group-wise the groups split like in,
    # as the dequantisation Mul takes the scale [out, in/G, 1] (the checkpoint layout cuts it the same way)
    assert lay["model.layers.0.self_attn.o_proj.weight_scale"] == ((1, 1) if group is None else (1, 2))
    assert lay["model.layers.0.self_attn.kv_b_proj.weight_scale"] == (2, 1)  # colwise: out split
    assert lay["model.layers.1.mlp.experts.gate_proj.weight_scale"] == (4, 2, 1)
    assert lay["model.layers.1.mlp.experts.down_proj.weight_offset"] == ((4, 1, 1) if group is None else (4, 1, 2))
    # the expert stacks' dequantisation Mul is split like their weights (q [E, out, in/G, G], scale [.., 1])
    assert strat[f"model.layers.1.mlp.experts.gate_proj.{mul}"][0] == ((4, 2, 1, 1), (4, 2, 1, 1))
    assert strat[f"model.layers.1.mlp.experts.down_proj.{mul}"][0] == (
        ((4, 1, 1, 2), (4, 1, 1, 1)) if group is None else ((4, 1, 2, 1), (4, 1, 2, 1))
    )
    assert strat[f"model.layers.0.self_attn.o_proj.{mul}"][0][0] == ((1, 1, 2) if group is None else (1, 2, 1))
    # every step of the dequantisation has the plan's strategy: under a pipeline (semi_auto) one without would split
    # its first axis over the stage's devices, and the weight and scales, which take the layout of the operator
    # that reads them, would be cut by rows (dp2 tp2 pp2 ep2 compiled them [48, 32] -> [12, 32])
    from ms_deepseek.model.quant import DEQUANT_PRIMITIVES, QuantLinear, QuantStackedWeight

    expand = "scale_expand" if group is None else "group_scale_expand"
    for path, cell in model.cells_and_names():
        if not isinstance(cell, (QuantLinear, QuantStackedWeight)):
            continue
        held = [a for a in DEQUANT_PRIMITIVES if getattr(cell, a, None) is not None]
        assert len(held) == 10, (path, held)  # int4: the three casts, the four nibble steps, one scale form, the Mul
        for attr in held:
            assert f"{path}.{attr}" in strat, f"{path}.{attr}"
        # the operators that read the Parameters take their layouts
        assert strat[f"{path}.unpack_first"][0] == (lay[f"{path}.weight"],), path
        assert strat[f"{path}.{expand}"][0] == (lay[f"{path}.weight_scale"],), path
