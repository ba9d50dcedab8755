"""Every layout-validator rule fails with one line naming the field and the numbers."""

import pytest

from ms_deepseek.config.model import get_preset
from ms_deepseek.config.parallel import ParallelConfig
from ms_deepseek.core.errors import UserError
from ms_deepseek.core.schema import from_dict
from ms_deepseek.parallel_plan.validate import layout_problems, validate_layout

V2 = get_preset("deepseek-v2")
LITE = get_preset("deepseek-v2-lite")
TINY = get_preset("tiny")


def _fails(message, parallel, cfg=V2, **kw):
    with pytest.raises(UserError) as err:
        validate_layout(parallel, cfg, **kw)
    assert str(err.value) == message
    assert "\n" not in str(err.value)


def test_valid_layouts_pass():
    validate_layout(
        ParallelConfig(dp=4, tp=8, pp=2, ep=4, micro_batches=20), V2, seq_len=4096, global_batch_size=80, world_size=64
    )
    validate_layout(
        ParallelConfig(dp=16, pp=10, ep=8, micro_batches=60), V2, seq_len=8192, global_batch_size=960, world_size=160
    )
    assert layout_problems(ParallelConfig(), TINY, seq_len=256, global_batch_size=8, micro_batch_size=8) == []


def test_world_size():
    _fails("parallel: world size 64 != dp*tp*pp = 4*8*1 = 32", ParallelConfig(dp=4, tp=8), world_size=64)


def test_heads_divisible_by_tp():
    _fails("parallel.tp: num_attention_heads=128 is not divisible by tp=3", ParallelConfig(tp=3))


def test_vocab_divisible_by_tp():
    cfg = V2.replace(vocab_size=102401, num_attention_heads=64, num_key_value_heads=64)
    _fails(
        "parallel.tp: vocab_size=102401 is not divisible by tp=2 (or set parallel.vocab_parallel: false)",
        ParallelConfig(tp=2),
        cfg,
    )
    # a replicated vocabulary lifts that rule
    assert not any("vocab_size" in p for p in layout_problems(ParallelConfig(tp=2, vocab_parallel=False), cfg))


def test_mlp_sizes_divisible_by_tp():
    _fails(
        "parallel.tp: intermediate_size=10944 is not divisible by tp=128",
        ParallelConfig(tp=128),
        LITE.replace(num_attention_heads=128, num_key_value_heads=128, vocab_size=102400),
    )
    cfg = LITE.replace(moe_intermediate_size=1400)
    _fails("parallel.tp: moe_intermediate_size=1400 is not divisible by tp=16", ParallelConfig(tp=16), cfg)


def test_experts_divisible_by_ep():
    _fails("parallel.ep: n_routed_experts=160 is not divisible by ep=3", ParallelConfig(dp=6, ep=3))


def test_ep_divides_dp_times_tp():
    _fails(
        "parallel.ep: ep=16 does not divide dp*tp = 2*4 = 8 (expert groups are carved out of one "
        "pipeline stage's devices)",
        ParallelConfig(dp=2, tp=4, ep=16),
    )


def test_ep_divides_dp():
    _fails(
        "parallel.ep: ep=4 does not divide dp=2 (MindSpore/MindFormers expert parallelism splits the "
        "data-parallel ranks into ep groups; tp splits each expert)",
        ParallelConfig(dp=2, tp=4, ep=4),
    )


def test_ep_needs_experts():
    dense = TINY.replace(n_routed_experts=None, num_experts_per_tok=None)
    _fails("parallel.ep: the model has no routed experts, so ep must be 1, got ep=2", ParallelConfig(dp=2, ep=2), dense)


def test_group_limited_routing_groups_match_ep():
    cfg = V2.replace(n_group=10, topk_group=3)  # 160 experts in 10 groups of 16
    _fails(
        "parallel.ep: group-limited routing maps n_group=10 expert groups to devices; ep=4 must divide "
        "n_group or be a multiple of it",
        ParallelConfig(dp=4, ep=4),
        cfg,
    )
    assert layout_problems(ParallelConfig(dp=16, ep=16), V2) == []  # 16 is a multiple of n_group 8
    assert layout_problems(ParallelConfig(dp=40, ep=20), cfg) == []  # 20 is a multiple of 10


def test_custom_placement_checked():
    bad = [0] * 8  # every expert on rank 0
    _fails(
        "parallel.expert_placement: EP rank 0 holds 8 experts, expected n_routed_experts / ep = 4",
        ParallelConfig(dp=2, ep=2, expert_placement=bad),
        TINY,
    )


def test_layers_split_into_stages():
    _fails(
        "parallel.pp: num_hidden_layers=4 cannot be split into pp=8 stages", ParallelConfig(pp=8, micro_batches=8), TINY
    )
    _fails(
        "parallel.stage_layers: [1, 2] sums to 3, expected num_hidden_layers=4",
        ParallelConfig(pp=2, micro_batches=2, stage_layers=[1, 2]),
        TINY,
    )


def test_micro_batches_at_least_pp():
    with pytest.raises(UserError) as err:
        from_dict(ParallelConfig, {"pp": 4, "micro_batches": 2}, "parallel")
    assert str(err.value) == (
        "parallel.micro_batches: 2 is fewer than pp=4 (1F1B needs at least one micro-batch per stage)"
    )
    # --set overrides are applied to the YAML before the config is built, so they meet the same check
    from ms_deepseek.core.schema import apply_overrides

    with pytest.raises(UserError, match="parallel.micro_batches: 2 is fewer than pp=4"):
        from_dict(ParallelConfig, apply_overrides({"pp": 4, "micro_batches": 4}, ["micro_batches=2"]), "parallel")


def test_sequence_parallel_needs_divisible_sequence():
    _fails(
        "parallel.sequence_parallel: seq_len=4095 is not divisible by tp=8",
        ParallelConfig(tp=8, sequence_parallel=True),
        seq_len=4095,
    )


def test_global_batch_divisible():
    _fails(
        "train.global_batch_size: 100 is not divisible by dp*micro_batch_size*micro_batches = 4*1*8 = 32",
        ParallelConfig(dp=4, pp=2, micro_batches=8),
        global_batch_size=100,
    )


def test_section_own_checks():
    for data, message in [
        ({"dp": 0}, "parallel.dp: must be >= 1, got 0"),
        ({"recompute": "some"}, "parallel.recompute: must be one of 'none', 'selective', 'full', got 'some'"),
        ({"pp": 2, "micro_batches": 2, "stage_layers": [4]}, "parallel.stage_layers: has 1 entries, expected pp=2"),
        ({"memory_headroom_gb": -1}, "parallel.memory_headroom_gb: must be >= 0, got -1.0"),
        ({"tpp": 2}, None),
    ]:
        with pytest.raises(UserError) as err:
            from_dict(ParallelConfig, data, "parallel")
        if message:
            assert str(err.value) == message
        else:
            assert str(err.value).startswith("parallel.tpp: unknown key (did you mean 'tp'?)")


def test_all_problems_listed_together():
    problems = layout_problems(ParallelConfig(dp=3, tp=3, ep=3), V2, world_size=10)
    assert [p.split(":")[0] for p in problems] == [
        "parallel",
        "parallel.tp",
        "parallel.tp",
        "parallel.ep",
        "parallel.ep",
        "parallel",
    ]


def test_sharded_world_is_one_two_four_or_a_multiple_of_eight():
    """MindSpore's semi-auto parallel refuses other device counts at init (device_manager.cc
    CheckDeviceConfig; the compile check of dp=3 stopped at "Parallel init failed"). Plain data
    parallel does not use that mode and keeps any world size."""
    _fails(
        "parallel: a sharded layout needs 1, 2 or 4 devices or a multiple of 8 (MindSpore's semi-auto "
        "parallel), got dp*tp*pp = 3*1*1 = 3",
        ParallelConfig(dp=3, optimizer_shard=True),
        LITE,
    )
    _fails(
        "parallel: a sharded layout needs 1, 2 or 4 devices or a multiple of 8 (MindSpore's semi-auto "
        "parallel), got dp*tp*pp = 3*2*1 = 6",
        ParallelConfig(dp=3, tp=2),
        LITE,
    )
    assert layout_problems(ParallelConfig(dp=3), LITE) == []  # plain data parallel
    for dp, tp, pp in [(2, 1, 1), (4, 1, 1), (1, 2, 4), (3, 8, 1), (5, 8, 2)]:
        assert layout_problems(ParallelConfig(dp=dp, tp=tp, pp=pp, micro_batches=pp), LITE) == []
