"""Optimizer sharding and checkpoints, simulated over the ranks of a layout on CPU.

MindSpore's parallel optimizer leaves each rank a part of its model-parallel slice (axis 0 split over
the parameter's optimizer-shard group). The groups are emulated here as MindSpore forms them (the
ranks holding the same slice, in rank order), the AllGather as the concatenation of the group's
parts in group-rank order. What is checked against MindSpore itself: the part each rank loads equals
what MindSpore's own loader (``mindspore.parallel._tensor._load_tensor_by_layout``, with the emulated
group functions) cuts for that rank from the whole tensor.
"""

import numpy as np
import pytest

from ms_deepseek.checkpoint.layout import build_layout, slice_array
from ms_deepseek.checkpoint.opt_shard import OptimizerShards, join_parts, own_part
from ms_deepseek.core.errors import UserError

from builders import small_config


def _parallel():
    from ms_deepseek.config.parallel import ParallelConfig

    return ParallelConfig(dp=4, tp=2, ep=2, optimizer_shard=True)


def _emulated_groups(layout):
    """(name, rank) -> (group name, ranks in it) for every tensor whose slice is replicated and splits
    along axis 0 (MindSpore's condition, threshold 0 here)."""
    out = {}
    for name, t in layout.tensors.items():
        holders = layout.ranks_holding(name)
        for rank in holders:
            same = tuple(r for r in holders if layout.slice_of(name, r) == layout.slice_of(name, rank))
            shape = t.slice_shape()
            if len(same) > 1 and shape and shape[0] % len(same) == 0:
                out[(name, rank)] = (f"opt-{name}-{same[0]}", same)
    return out


def _shards_of(rank, groups, held):
    """The rank's OptimizerShards with emulated group functions and an emulated AllGather over ``held``
    (rank -> name -> what that rank holds)."""
    mine = {name: g for (name, r), (g, _) in groups.items() if r == rank}
    members = {g: ranks for (_, _), (g, ranks) in groups.items()}
    names = {g: name for (name, _), (g, _) in groups.items()}

    def gather(group, _value):
        return join_parts(held[r][names[group]] for r in members[group])

    return OptimizerShards(mine, lambda g: len(members[g]), lambda g: members[g].index(rank), gather)


def test_each_rank_loads_the_part_mindspores_loader_cuts_and_saving_gathers_the_slice(monkeypatch):
    import mindspore as ms
    import mindspore.parallel._tensor as ms_tensor

    cfg = small_config()
    layout = build_layout(cfg, _parallel())
    groups = _emulated_groups(layout)
    assert groups, "no tensor is optimizer-sharded in this layout"
    rng = np.random.default_rng(0)
    full = {n: rng.standard_normal(t.shape).astype(np.float32) for n, t in layout.tensors.items()}

    held = {}
    for rank in range(layout.world_size):
        shards = _shards_of(rank, groups, held)
        held[rank] = {n: shards.part(n, slice_array(full[n], layout.slice_of(n, rank))) for n in layout.tensors}
        for name, t in layout.tensors.items():
            group, ranks = groups.get((name, rank), ("", (rank,)))
            monkeypatch.setattr(ms_tensor, "get_rank", lambda g=None, ranks=ranks, rank=rank: ranks.index(rank))
            monkeypatch.setattr(ms_tensor, "get_group_size", lambda g=None, ranks=ranks: len(ranks))
            entry = (list(t.dev_matrix), list(t.tensor_map), list(t.slice_shape()), 0, 1, group, list(t.shape))
            want = ms_tensor._load_tensor_by_layout(ms.Tensor(full[name]), entry, rank).asnumpy()
            np.testing.assert_array_equal(held[rank][name], want, err_msg=f"{name} rank {rank}")
            if group:
                assert held[rank][name].shape[0] * len(ranks) == t.slice_shape()[0]

    # saving: every rank writes its model-parallel slice again (what layout.json describes)
    for rank in range(layout.world_size):
        saved = _shards_of(rank, groups, held).gathered(held[rank])
        for name in layout.tensors:
            np.testing.assert_array_equal(
                saved[name], slice_array(full[name], layout.slice_of(name, rank)), err_msg=f"{name} rank {rank}"
            )


def test_restore_into_hands_a_lazily_built_rank_its_part():
    """restore_into's part hook on the lazily built model, as the trainer calls it after the compile."""
    import tempfile
    from pathlib import Path

    from mindspore.nn.utils import no_init_parameters

    from ms_deepseek.checkpoint.convert.synthetic import write_random_checkpoint
    from ms_deepseek.checkpoint.slice_readers import WholeSource
    from ms_deepseek.checkpoint.tensors import model_tensors, restore_into
    from ms_deepseek.checkpoint.weight_files import read_weight_files
    from ms_deepseek.model.causal_lm import DeepseekV2ForCausalLM

    cfg = small_config()
    layout = build_layout(cfg, _parallel())
    groups = _emulated_groups(layout)
    rank = 3
    shards = _shards_of(rank, groups, {})
    with tempfile.TemporaryDirectory() as tmp:
        write_random_checkpoint(Path(tmp) / "hf", cfg, dtype="float32", layout="hf", seed=4)
        src = WholeSource.of(read_weight_files(Path(tmp) / "hf"))
        with no_init_parameters():
            model = DeepseekV2ForCausalLM(cfg)
        params = {n: p for n, p in model_tensors(model).items() if n in layout.tensors}
        restore_into(params, src, "model", layout=layout, rank=rank, part=shards.part)
        from ms_deepseek.checkpoint.slice_readers import full_slice

        cut = 0
        for name, param in params.items():
            t = layout.tensors[name]
            whole = src.read(name, full_slice(t.shape, t.experts is not None)).view(np.float32)
            want = shards.part(name, slice_array(whole, layout.slice_of(name, rank)))
            np.testing.assert_array_equal(param.asnumpy(), want, err_msg=name)
            cut += want.shape != t.slice_shape()
        assert cut == len([1 for (n, r) in groups if r == rank])


def test_a_slice_that_does_not_split_is_named():
    with pytest.raises(UserError, match=r"optimizer sharding: w slice \[3, 2\] does not split 2 ways"):
        own_part(np.zeros((3, 2)), 2, 0, "w")
    np.testing.assert_array_equal(own_part(np.arange(6).reshape(3, 2), 1, 0), np.arange(6).reshape(3, 2))
