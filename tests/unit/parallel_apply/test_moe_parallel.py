"""The expert-parallel MoE: per-group dispatch, the parallel degrees from the plan, the dispatch shapes
the planner reads, and the CPU simulation of the sharded layer (forward and backward) with plans that
are right and plans that are deliberately wrong.

SEMI_AUTO_PARALLEL cannot compile on CPU: the sharded semantics are checked by
:func:`ms_deepseek.simulation.moe_layer.simulate_moe_layer`, which runs every virtual rank's share.
"""

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor

from ms_deepseek.config import dispatch_shapes
from ms_deepseek.config.model import get_preset
from ms_deepseek.config.parallel import ParallelConfig
from ms_deepseek.core.errors import UserError
from ms_deepseek.model.causal_lm import DeepseekV2ForCausalLM
from ms_deepseek.model.moe import DeepseekV2MoE
from ms_deepseek.parallel_apply.apply import apply_plan
from ms_deepseek.parallel_plan.plan import Mesh
from ms_deepseek.simulation.moe_layer import simulate_moe_layer


def small_cfg(**kw):
    base = dict(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        moe_intermediate_size=8,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        kv_lora_rank=8,
        q_lora_rank=None,
        qk_rope_head_dim=4,
        qk_nope_head_dim=4,
        v_head_dim=4,
        n_routed_experts=8,
        num_experts_per_tok=2,
        topk_method="greedy",
        n_group=1,
        topk_group=1,
        n_shared_experts=1,
        capacity_factor=1.0,
        initializer_range=0.3,
        first_k_dense_replace=1,
    )
    base.update(kw)
    return get_preset("tiny", **base)


@pytest.fixture(autouse=True)
def pynative():
    old = ms.get_context("mode")
    ms.set_context(mode=ms.PYNATIVE_MODE)
    yield
    ms.set_context(mode=old)


def _planned_layer(cfg, **layout):
    model = DeepseekV2ForCausalLM(cfg)
    parallel = ParallelConfig(**layout)
    apply_plan(model, parallel, cfg)
    return model.model.layers[1].mlp, Mesh.from_parallel(parallel)


def _tokens(cfg, rows, seq=8, seed=1):
    return Tensor(np.random.default_rng(seed).standard_normal((rows, seq, cfg.hidden_size)).astype(np.float32))


# ----------------------------------------------------------------------------- per-group dispatch


def test_groups_route_and_drop_each_group_alone():
    # G groups in one call == each group's rows through a G = 1 layer: capacity, positions and drops
    # are per data-parallel rank (a rank never sees another rank's tokens).
    cfg = small_cfg()
    moe = DeepseekV2MoE(cfg)
    moe.set_train(True)
    x = _tokens(cfg, 4, seq=6)
    moe.groups = 4
    y_groups = moe(x)[0].asnumpy()
    moe.groups = 1
    y_alone = np.concatenate([moe(x[g : g + 1])[0].asnumpy() for g in range(4)])
    # float32 matmuls of different shapes (4 groups at once, 1 at a time) round differently, and MindSpore's CPU
    # kernels split the work by thread: the full suite on 2 cores once differed by 1.6e-6 at |y| ~ 0.16. A
    # routing or drop difference moves outputs by far more (the pooled dispatch below: > 1e-4).
    np.testing.assert_allclose(y_groups, y_alone, rtol=1e-5, atol=1e-6)
    # ... and differs from pooling the capacity over all tokens (the old, non-local dispatch)
    pooled = moe(x)[0].asnumpy()
    assert np.abs(pooled - y_groups).max() > 1e-4


def test_dispatch_shapes_are_the_buffers_as_built():
    cfg = small_cfg(capacity_factor=1.5)
    moe = DeepseekV2MoE(cfg)
    moe.set_train(True)
    G, N = 4, 12
    moe.groups = G
    buffer, route = moe.dispatch(_tokens(cfg, G, seq=N).reshape(G, N, cfg.hidden_size))
    shapes = dispatch_shapes.dispatch_buffers(cfg, dp=G, ep=2, tp=1, tokens_per_group=N, training=True)
    C = shapes["capacity"]
    assert C == moe.capacity(N) == 5  # ceil(1.5 * 12 * 2 / 8)
    assert tuple(buffer.shape) == shapes["buffers"]["dispatch_buffer"]["global"] == (G, 8, C, 16)
    assert tuple(route[3].shape) == shapes["buffers"]["combine_index"]["global"]
    assert shapes["buffers"]["expert_input"]["per_device"] == (1, 4, 2 * C, 16)  # [1, E/ep, ep*C, H]
    assert shapes["alltoall_elements_per_device"] == 8 * C * 16 // 2
    eval_shapes = dispatch_shapes.dispatch_buffers(cfg, dp=G, ep=2, tp=1, tokens_per_group=N, training=False)
    assert eval_shapes["capacity"] == N  # dropless


# ------------------------------------------------------------------ one source for the degrees


def test_device_loss_groups_come_from_the_plan_not_the_config():
    cfg = small_cfg(seq_aux=False)
    x = _tokens(cfg, 2)
    plain = DeepseekV2ForCausalLM(cfg)
    ep_config = DeepseekV2ForCausalLM(cfg.replace(ep_size=4))  # the HF key alone changes nothing
    for p_a, p_b in zip(plain.get_parameters(), ep_config.get_parameters()):
        p_b.set_data(p_a.data)
    a, b = plain.model.layers[1].mlp, ep_config.model.layers[1].mlp
    assert a.gate.num_devices == b.gate.num_devices == 1
    np.testing.assert_array_equal(a(x)[2].asnumpy(), b(x)[2].asnumpy())
    apply_plan(ep_config, ParallelConfig(dp=4, ep=4), cfg)  # the plan's ep = 4
    assert (b.gate.num_devices, b.groups, b.ep, b.lookup.experts_per_rank) == (4, 4, 4, 2)
    l_dev_1 = float(a(x)[2].asnumpy()[cfg.n_routed_experts + 2])
    l_dev_4 = float(b(x)[2].asnumpy()[cfg.n_routed_experts + 2])
    assert abs(l_dev_1 - l_dev_4) > 1e-6  # device-level loss over 4 device groups, not 1


def test_plan_refuses_ep_not_dividing_dp():
    cfg = small_cfg()
    with pytest.raises(UserError, match="ep=4 must divide dp=2"):
        apply_plan(DeepseekV2ForCausalLM(cfg), ParallelConfig(dp=2, ep=4), cfg)


# ------------------------------------------------------------------------- sharded simulation


@pytest.mark.parametrize("layout", [dict(dp=2, tp=2, ep=2), dict(dp=4, ep=2)], ids=["dp2-tp2-ep2", "dp4-ep2"])
def test_simulated_sharded_layer_equals_unsharded(layout):
    cfg = small_cfg()
    layer, mesh = _planned_layer(cfg, **layout)
    report = simulate_moe_layer(layer, _tokens(cfg, layout["dp"]), mesh)
    assert report["problem"] is None
    assert report["ranks"] == layout["dp"] and report["dropped"] > 0  # capacity 1.0 drops: drops agree too
    assert report["forward_max_err"] < 1e-5 and report["backward_max_err"] < 1e-5


def test_simulation_catches_experts_split_by_dp():
    cfg = small_cfg()
    layer, mesh = _planned_layer(cfg, dp=4, ep=2)
    wrong = ((4, 1, 1), (4, 1, 1))  # experts split by dp instead of ep
    layer.experts.gate_bmm.shard(wrong)
    layer.experts.up_bmm.shard(wrong)
    layer.experts.down_bmm.shard(wrong)
    report = simulate_moe_layer(layer, _tokens(cfg, 4), mesh)
    assert report["problem"] and report["forward_max_err"] == float("inf")


def test_simulation_catches_a_dispatch_that_is_not_per_rank():
    cfg = small_cfg()
    layer, mesh = _planned_layer(cfg, dp=2, ep=2)
    layer.dispatch_gather.shard(((1, 1, 1), (1, 1, 1)))  # the token groups replicated
    report = simulate_moe_layer(layer, _tokens(cfg, 2), mesh)
    assert "dispatch_gather" in report["problem"]


def test_grouped_exchange_graph_mode_equals_pynative():
    # G = 4 groups viewed (dp/ep 2, ep 2) through the exchange transposes: one compiled graph, forward and
    # gradients, equal to PyNative (graph mode is what Ascend runs).
    cfg = small_cfg()
    moe = DeepseekV2MoE(cfg)
    moe.set_train(True)
    moe.groups, moe.ep = 4, 2
    x = _tokens(cfg, 4, seq=6)
    weights = moe.trainable_params()

    def loss(xx):
        y, aux, *_ = moe(xx)
        return (y * y).sum() + aux

    eager_loss, (eager_gx, eager_gw) = ms.value_and_grad(loss, 0, weights)(x)
    ms.set_context(mode=ms.GRAPH_MODE)
    graph_loss, (graph_gx, graph_gw) = ms.jit(ms.value_and_grad(loss, 0, weights))(x)
    np.testing.assert_allclose(graph_loss.asnumpy(), eager_loss.asnumpy(), rtol=1e-6)
    for a, b in zip((graph_gx,) + tuple(graph_gw), (eager_gx,) + tuple(eager_gw)):
        np.testing.assert_allclose(a.asnumpy(), b.asnumpy(), rtol=1e-5, atol=1e-6)
