"""The sharding plan applied to a built tiny model: strategies read back from the primitives,
parameter layouts, pipeline stages, recompute, expert placement, and the planner's parameter /
gradient / optimizer bytes against the bytes counted from the model's own parameters.

SEMI_AUTO_PARALLEL cannot compile on CPU, so these tests inspect what was applied; they
compile nothing (one PyNative forward checks that a custom expert placement keeps the math).
"""

import numpy as np
import pytest

from ms_deepseek.config.model import get_preset
from ms_deepseek.config.parallel import ParallelConfig
from ms_deepseek.core.errors import UserError
from ms_deepseek.parallel_plan.costs import param_bytes
from ms_deepseek.parallel_plan.plan import DEEPSEEK_V2_PLAN, Plan, parameter_inventory
from ms_deepseek.parallel_plan.workload import Precision

CFG = get_preset("tiny")
STRATEGIC = ("MatMul", "BatchMatMul", "Gather", "TopK", "FlashAttentionScore", "Custom", "Sort", "Transpose", "Concat")


@pytest.fixture(scope="module")
def model():
    import mindspore as ms

    from ms_deepseek.model.causal_lm import DeepseekV2ForCausalLM

    ms.set_context(mode=ms.PYNATIVE_MODE)
    ms.set_seed(0)
    return DeepseekV2ForCausalLM(CFG)


def _primitives(model):
    from mindspore.ops.primitive import Primitive

    for path, cell in model.cells_and_names():
        for attr, value in vars(cell).items():
            if isinstance(value, Primitive):
                yield f"{path}.{attr}" if path else attr, value
        for attr, value in getattr(cell, "_primitives", {}).items():
            if isinstance(value, Primitive):
                yield f"{path}.{attr}" if path else attr, value


def _layout_from_model(model):
    """Parameter name -> layout, read from the strategy of the primitive that consumes it.

    Written from the model's structure (which primitive reads which parameter), independently
    of the plan's own parameter table."""
    cells = dict(model.cells_and_names())
    out = {}
    for param in model.get_parameters():
        path, leaf = param.name.rsplit(".", 1)
        cell = cells.get(path)
        parent_path, attr = path.rsplit(".", 1) if "." in path else ("", path)
        parent = cells.get(parent_path)
        if leaf == "weight" and hasattr(cell, "matmul"):  # Linear, router
            out[param.name] = cell.matmul.attrs["in_strategy"][1]
        elif leaf == "bias":
            out[param.name] = cell.add_bias.attrs["in_strategy"][1]
        elif leaf == "weight" and hasattr(cell, "gather"):  # embedding
            out[param.name] = cell.gather.attrs["in_strategy"][0]
        elif leaf == "weight" and hasattr(parent, "gate_bmm"):  # stacked experts
            bmm = getattr(parent, attr.replace("_proj", "_bmm"))
            out[param.name] = bmm.attrs["in_strategy"][1]
        else:  # norms, placement table
            out[param.name] = (1,) * len(param.shape)
    return out


def _stage_of(model, name, pp):
    if name.startswith("model.layers."):
        return model.model.layers[int(name.split(".")[2])].pipeline_stage if pp > 1 else 0
    if name.startswith("model.embed_tokens"):
        return model.model.embed_tokens.pipeline_stage if pp > 1 else 0
    return model.lm_head.pipeline_stage if pp > 1 else 0


def _counted_bytes(model, parallel):
    """Per-stage weight / gradient / optimizer bytes from the model's parameters (MindSpore rules:
    gradients in the parameter dtype, AdamW m and v float32, parallel optimizer shards a slice
    over its replicas along axis 0 when that divides and the whole parameter is >= 64 KB:
    opt_param_mgr.cc SplitParam, confirmed by compiling in tests/compile)."""
    layouts = _layout_from_model(model)
    devices = parallel.dp * parallel.tp
    out = [dict(weights=0, gradients=0, optimizer=0) for _ in range(parallel.pp)]
    trainable = {p.name for p in model.trainable_params()}
    for param in model.get_parameters():
        layout = layouts[param.name]
        shape = [d // k for d, k in zip(param.shape, layout)]
        local = int(np.prod(shape))
        size = np.dtype(ms_to_np(param.dtype)).itemsize
        replicas = devices // int(np.prod(layout))
        group = 1
        if (
            parallel.optimizer_shard
            and param.name in trainable
            and replicas > 1
            and shape[0] % replicas == 0
            and int(np.prod(param.shape)) * size >= 64 * 1024
        ):
            group = replicas
        slot = out[_stage_of(model, param.name, parallel.pp)]
        slot["weights"] += local * size / group
        if param.name in trainable:
            slot["gradients"] += local * size
            slot["optimizer"] += local * 8 / group
    return out


def ms_to_np(dtype):
    import mindspore as ms

    return {ms.float32: np.float32, ms.int32: np.int32, ms.float16: np.float16}[dtype]


LAYOUTS = [
    ParallelConfig(),
    ParallelConfig(dp=2, tp=2, pp=2, ep=2, micro_batches=4, optimizer_shard=True),
    ParallelConfig(dp=4, tp=2, ep=4, optimizer_shard=True, sequence_parallel=True),
    ParallelConfig(dp=2, tp=4, pp=2, micro_batches=2, optimizer_shard=True, vocab_parallel=False),
    ParallelConfig(dp=8, ep=8, optimizer_shard=False),
]


@pytest.mark.parametrize("parallel", LAYOUTS, ids=lambda p: p.describe().replace(" ", "-"))
def test_applied_strategies_and_planner_bytes(model, parallel):
    from ms_deepseek.parallel_apply.apply import apply_plan

    applied = apply_plan(model, parallel, CFG)
    dp, tp, ep = parallel.dp, parallel.tp, parallel.ep
    # every primitive that needs a strategy has one, equal to what the plan recorded
    prims = dict(_primitives(model))
    needing = {p for p, prim in prims.items() if type(prim).__name__ in STRATEGIC}
    assert needing and needing <= set(applied.strategies)
    from mindspore.parallel._tensor import _get_tensor_strategy

    def recorded(prim):  # a Custom op is sharded with Layouts (in_layout), the rest with strategies
        if "in_layout" in prim.attrs:
            return tuple(
                tuple(_get_tensor_strategy(list(lay["device_matrix"]), list(lay["tensor_map"])))
                for lay in prim.attrs["in_layout"]
            )
        return tuple(prim.attrs["in_strategy"])

    for path in needing:
        assert recorded(prims[path]) == tuple(map(tuple, applied.strategies[path][0])), path
    # spot checks against the plan's meaning
    layer = model.model.layers[1]
    # the MoE's degrees come from the plan: one token group per dp rank, the exchange view by ep
    assert (layer.mlp.groups, layer.mlp.ep, layer.mlp.capacity_multiple) == (dp, ep, 1)
    assert recorded(layer.mlp.lookup.impl.op)[:2] == ((dp, 1), (1, 1))  # the custom op, per group
    assert layer.mlp.dispatch_gather.attrs["in_strategy"] == ((dp, 1, 1), (dp, 1, 1))
    # the exchange view [G/ep, ep, E, C, H] read with E split by ep: ep the inner factor of dp
    assert layer.mlp.to_experts.attrs["in_strategy"] == ((dp // ep, 1, ep, 1, 1),)
    assert layer.self_attn.kv_b_proj.matmul.attrs["in_strategy"] == ((dp, 1), (tp, 1))  # colwise
    assert layer.self_attn.o_proj.matmul.attrs["in_strategy"] == ((dp, tp), (1, tp))  # rowwise
    if parallel.sequence_parallel:
        assert layer.self_attn.o_proj.matmul.attrs["out_strategy"] == ((dp * tp, 1),)
    assert layer.self_attn.qk_bmm.attrs["in_strategy"] == ((dp, tp, 1, 1), (dp, tp, 1, 1))
    assert layer.mlp.experts.gate_bmm.attrs["in_strategy"] == ((dp // ep, ep, 1, 1), (ep, tp, 1))
    assert layer.mlp.experts.down_bmm.attrs["in_strategy"] == ((dp // ep, ep, 1, tp), (ep, 1, tp))
    vocab = tp if parallel.vocab_parallel else 1
    assert model.model.embed_tokens.gather.attrs["in_strategy"] == ((vocab, 1), (dp, 1))
    assert model.lm_head.matmul.attrs["in_strategy"] == ((dp, 1), (vocab, 1))
    # the loss keeps the logits [N, V] as lm_head leaves them, (dp, vocab split): every op over V
    # is a partial reduction; the target logit by a one-hot slice on a split vocabulary (GatherD cannot
    # split its gather axis), by GatherD on a whole one (no [N, V] one-hot)
    loss = model.loss_fn
    head_out = (dp, model.lm_head.matmul.attrs["in_strategy"][1][0])
    for attr in ("row_max", "exp", "sum_exp"):
        assert getattr(loss, attr).attrs["in_strategy"] == (head_out,), attr
    assert loss.sub.attrs["in_strategy"] == (head_out, (dp, 1))
    assert loss.split_vocab == (vocab > 1)
    if vocab > 1:
        assert loss.pick.attrs["in_strategy"] == (head_out,)
        assert loss.mul.attrs["in_strategy"] == (head_out, head_out)
        assert loss.onehot.attrs["in_strategy"] == (head_out, (), ())
        assert "loss_fn.gather_target" not in applied.strategies
    else:
        assert loss.gather_target.attrs["in_strategy"] == ((dp, 1), (dp, 1))
        assert "loss_fn.onehot" not in applied.strategies
    if parallel.pp > 1:
        assert loss.pipeline_stage == model.lm_head.pipeline_stage == parallel.pp - 1
    # each strategy uses at most the stage's devices and divides every axis it splits
    for path, (in_s, _) in applied.strategies.items():
        for tensor in in_s:
            assert (dp * tp) % int(np.prod(tensor)) == 0, path
    # parameter layouts: every parameter has one, equal to the consuming primitive's strategy
    from_model = _layout_from_model(model)
    assert set(applied.param_layouts) == {p.name for p in model.get_parameters()}
    for name, layout in applied.param_layouts.items():
        assert tuple(layout) == tuple(from_model[name]), name
    # pipeline stages
    if parallel.pp > 1:
        assert [lyr.pipeline_stage for lyr in model.model.layers] == [0, 0, 1, 1]
        assert model.model.embed_tokens.pipeline_stage == 0 and model.lm_head.pipeline_stage == 1
    # the planner's bytes, from the config alone, equal the model's
    predicted = param_bytes(CFG, parallel, Precision(compute_bytes=4))
    counted = _counted_bytes(model, parallel)
    for s in range(parallel.pp):
        for key in ("weights", "gradients", "optimizer"):
            assert predicted[s][key] == pytest.approx(counted[s][key], rel=0, abs=0), (s, key)


def test_inventory_matches_model(model):
    inventory = {p.name: p for p in parameter_inventory(CFG)}
    params = {p.name: p for p in model.get_parameters()}
    assert set(inventory) == set(params)
    for name, param in params.items():
        assert inventory[name].shape == tuple(param.shape), name
        assert inventory[name].trainable == param.requires_grad, name
    total = sum(int(np.prod(p.shape)) for p in model.trainable_params())
    from ms_deepseek.config.inventory import count_parameters

    assert total == count_parameters(CFG).total


def test_plan_table_rules():
    plan = Plan()
    assert plan.match("model.layers.17.self_attn.kv_b_proj") == ("model.layers.*.self_attn.kv_b_proj", "colwise")
    assert plan.match("model.layers.3.mlp.experts") == ("model.layers.*.mlp.experts", "experts")
    assert plan.match("model.layers.3.mlp") is None
    with pytest.raises(UserError, match="matches several patterns"):
        Plan({**DEEPSEEK_V2_PLAN, "model.layers.*.self_attn.*": "replicate"}).match("model.layers.0.self_attn.o_proj")
    from ms_deepseek.parallel_plan.plan import Mesh

    with pytest.raises(UserError, match="no rule covers parameter 'model.layers.0.extra.weight'"):
        plan.param_layout("model.layers.0.extra.weight", Mesh())


def test_missing_rule_is_reported(model):
    from ms_deepseek.parallel_apply.apply import apply_plan

    table = {k: v for k, v in DEEPSEEK_V2_PLAN.items() if k != "model.layers.*.self_attn.pv_bmm"}
    with pytest.raises(
        UserError, match=r"primitive model\.layers\.0\.self_attn\.pv_bmm \(BatchMatMul\) matches no rule"
    ):
        apply_plan(model, ParallelConfig(), CFG, Plan(table))


def test_custom_placement_keeps_the_math_and_recompute():
    """A re-balanced expert placement changes data only: same logits; weights restore to expert order."""
    import mindspore as ms

    from ms_deepseek.model.causal_lm import DeepseekV2ForCausalLM
    from ms_deepseek.parallel_apply.apply import apply_plan, restore_expert_order
    from ms_deepseek.parallel_plan.placement import placement_table

    cfg = CFG.replace(num_hidden_layers=2)
    ms.set_context(mode=ms.PYNATIVE_MODE)
    ms.set_seed(1)
    net = DeepseekV2ForCausalLM(cfg)
    net.set_train(False)
    ids = ms.Tensor(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 12)), ms.int32)
    before = net(ids).logits.asnumpy()
    original = net.model.layers[1].mlp.experts.up_proj.weight.asnumpy().copy()
    assignment = [1, 0, 1, 0, 0, 1, 1, 0]
    parallel = ParallelConfig(dp=2, ep=2, expert_placement=assignment, recompute="full")
    applied = apply_plan(net, parallel, cfg)
    moe = net.model.layers[1].mlp
    np.testing.assert_array_equal(moe.expert_placement.asnumpy(), placement_table(8, 2, assignment))
    assert moe.lookup.experts_per_rank == 4
    after = net(ids).logits.asnumpy()
    np.testing.assert_allclose(after, before, rtol=1e-5, atol=1e-5)
    stored = moe.experts.up_proj.weight
    assert not np.array_equal(stored.asnumpy(), original)  # permuted into buffer order
    np.testing.assert_array_equal(restore_expert_order(stored.name, stored.asnumpy(), applied), original)
    np.testing.assert_array_equal(restore_expert_order("adam_m." + stored.name, stored.asnumpy(), applied), original)
    assert applied.recomputed == ["model.layers.0", "model.layers.1"]
    assert all(net.model.layers[i]._has_config_recompute for i in range(2))


def test_full_recompute_under_a_pipeline_marks_whole_layers():
    """With or without a pipeline "full" recompute marks each decoder layer as one segment, never its sub-cells
    (which keep four [tokens, H] a layer: parallel_apply.apply.recompute_segments)."""
    import mindspore as ms

    from ms_deepseek.model.causal_lm import DeepseekV2ForCausalLM
    from ms_deepseek.parallel_apply.apply import apply_plan

    cfg = CFG.replace(num_hidden_layers=2)
    ms.set_context(mode=ms.PYNATIVE_MODE)
    net = DeepseekV2ForCausalLM(cfg)
    applied = apply_plan(net, ParallelConfig(pp=2, micro_batches=4, recompute="full"), cfg)
    assert applied.recomputed == ["model.layers.0", "model.layers.1"]
    assert all(net.model.layers[i]._has_config_recompute for i in range(2))


def test_selective_recompute_and_stage_config():
    import mindspore as ms

    from ms_deepseek.model.causal_lm import DeepseekV2ForCausalLM
    from ms_deepseek.parallel_apply.apply import apply_plan, pipeline_stage_config

    cfg = CFG.replace(num_hidden_layers=2)
    ms.set_context(mode=ms.PYNATIVE_MODE)
    net = DeepseekV2ForCausalLM(cfg)
    applied = apply_plan(net, ParallelConfig(pp=2, micro_batches=4, recompute="selective"), cfg)
    assert applied.recomputed == [f"model.layers.{i}.self_attn.{p}" for i in range(2) for p in ("qk_bmm", "softmax")]
    attn = net.model.layers[0].self_attn
    assert attn.qk_bmm.attrs.get("recompute") is True and attn.softmax._has_config_recompute
    assert not net.model.layers[0]._has_config_recompute  # the rest of the layer keeps its activations
    assert pipeline_stage_config(applied, "lm") == {
        "lm.model.embed_tokens": 0,
        "lm.model.norm": 1,
        "lm.lm_head": 1,
        "lm.loss_fn": 1,  # the loss runs where the logits are
        "lm.model.layers.0": 0,
        "lm.model.layers.1": 1,
    }


def test_flash_attention_primitive_gets_heads_by_tp():
    """With use_flash_attention (Ascend) the fused attention primitive is sharded batch x heads."""
    import mindspore as ms

    from ms_deepseek.model.causal_lm import DeepseekV2ForCausalLM
    from ms_deepseek.parallel_apply.apply import apply_plan

    ms.set_context(mode=ms.PYNATIVE_MODE)
    cfg = CFG.replace(use_flash_attention=True)
    net = DeepseekV2ForCausalLM(cfg)
    apply_plan(net, ParallelConfig(dp=2, tp=2), cfg)
    fa = net.model.layers[0].self_attn.flash_attention
    assert fa.attrs["in_strategy"] == ((2, 2, 1, 1), (2, 2, 1, 1), (2, 2, 1, 1), (1, 1))
    assert not hasattr(DeepseekV2ForCausalLM(CFG).model.layers[0].self_attn, "flash_attention")
    with pytest.raises(UserError, match="use_flash_attention: FlashAttentionScore runs only on Ascend"):
        net(ms.Tensor(np.zeros((1, 4), np.int32)))
