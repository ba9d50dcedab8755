"""The compiled step's traffic read from MindSpore's IR (verification/compile/traffic.py), on IR lines in the form MindSpore 2.9
dumps after its ``validate`` pass (``MS_DEV_SAVE_GRAPHS``)."""

import pytest

from ms_deepseek.config.parallel import ParallelConfig
from ms_deepseek.verification.compile import traffic as tr

# An optimizer shard's gather of a float32 parameter (Ref input [12800, 2048], output 8x larger), a gather of a cast
# (Tensor input), the reduce-scatter of an accumulation buffer (Ref input [102400, 2048]), an AlltoAll in a group of
# 8, a tensor-parallel all-reduce (group 0-1), and a Send.
IR = """\
  %0(CNode_256) = AllGather(%para3_model.embed_tokens.weight) {instance name: parallel_optimizer_allgather_not_recompute} primitive_attrs: {group: "hccl_world_group", group_rank_ids: (0, 1, 2, 3, 4, 5, 6, 7), rank_size: I64(8)}
      : (<Ref[Tensor[Float32]], (12800, 2048), ref_key=model.embed_tokens.weight, is_parameter, is_inplace>) -> (<Tensor[Float32], (102400, 2048)>)
      # Fullname with scope: (Default/network-TrainStep/model-DeepseekV2Model/AllGather-op0)
  %19(CNode_270) = AllGather(%18) {instance name: parallel_optimizer_allgather_not_recompute} primitive_attrs: {group_rank_ids: (0, 1, 2, 3, 4, 5, 6, 7), rank_size: I64(8)}
      : (<Tensor[BFloat16], (384, 2048)>) -> (<Tensor[BFloat16], (3072, 2048)>)
      # Fullname with scope: (Default/q_proj-Linear/AllGather-op0)
  %40(CNode_9) = ReduceScatter(%para90_accu_grads.model.embed_tokens.weight) primitive_attrs: {group_rank_ids: (0, 1, 2, 3, 4, 5, 6, 7), rank_size: I64(8)}
      : (<Ref[Tensor[Float32]], (102400, 2048), ref_key=accu_grads.model.embed_tokens.weight, is_parameter, is_inplace>) -> (<Tensor[Float32], (12800, 2048)>)
      # Fullname with scope: (Gradients/Grad__MicroStepAllGather/ReduceScatter-op0)
  %50(CNode_1) = AlltoAll(%49) primitive_attrs: {split_count: I64(8), group_rank_ids: (0, 1, 2, 3, 4, 5, 6, 7)}
      : (<Tensor[BFloat16], (1, 64, 768, 2048)>) -> (<Tensor[BFloat16], (8, 8, 768, 2048)>)
      # Fullname with scope: (Default/mlp-DeepseekV2MoE/AlltoAll-op0)
  %60(CNode_2) = AllReduce(%59) {instance name: forward_op_123} primitive_attrs: {group_rank_ids: (0, 1), rank_size: I64(2)}
      : (<Tensor[BFloat16], (4096, 2048)>) -> (<Tensor[BFloat16], (4096, 2048)>)
      # Fullname with scope: (Default/o_proj-Linear/AllReduce-op0)
  %70(CNode_3) = Send(%69) primitive_attrs: {dest_rank: I64(8), group_rank_ids: (0, 8), sr_tag: I64(0)}
      : (<Tensor[BFloat16], (4096, 2048)>) -> (<Tensor[BFloat16], (4096, 2048)>)
      # Fullname with scope: (Default/Send-op0)
  %80(CNode_4) = ReduceScatter(%79) {instance name: grad_parallel_optimizer_allgather_not_recompute} primitive_attrs: {group_rank_ids: (0, 1), rank_size: I64(2)}
      : (<Tensor[Float32], (1536, 5120)>) -> (<Tensor[Float32], (768, 5120)>)
      # Fullname with scope: (Gradients/q_a_proj-Linear/Grad__MicroStepAllGather/ReduceScatter-op0)
"""

MIB = 2**20


@pytest.fixture
def ops(tmp_path):
    path = tmp_path / "20_validate_1.ir"
    path.write_text(IR)
    return tr.read_ops(path)


def test_each_operator_is_read_from_its_input(ops):
    """A Ref input (a parameter or buffer the operator reads directly) is the operator's input, not its output."""
    assert [(op.kind, op.dtype, op.shape) for op in ops] == [
        ("AllGather", "Float32", (12800, 2048)),
        ("AllGather", "BFloat16", (384, 2048)),
        ("ReduceScatter", "Float32", (102400, 2048)),
        ("AlltoAll", "BFloat16", (1, 64, 768, 2048)),
        ("AllReduce", "BFloat16", (4096, 2048)),
        ("Send", "BFloat16", (4096, 2048)),
        ("ReduceScatter", "Float32", (1536, 5120)),
    ]
    assert ops[0].group == tuple(range(8)) and ops[4].group == (0, 1)
    assert ops[2].scope.endswith("ReduceScatter-op0")


def test_bytes_sent_on_a_ring(ops):
    gather, cast_gather, scatter, a2a, allreduce, send, _ = ops
    assert gather.wire_mib == pytest.approx(7 * 12800 * 2048 * 4 / MIB)  # its slice to the 7 others
    assert scatter.wire_mib == pytest.approx(7 / 8 * 102400 * 2048 * 4 / MIB)
    assert gather.wire_mib == pytest.approx(scatter.wire_mib)  # a parameter's gather and its gradient's scatter
    assert a2a.wire_mib == pytest.approx(7 / 8 * 64 * 768 * 2048 * 2 / MIB)
    assert allreduce.wire_mib == pytest.approx(2 * 1 / 2 * 4096 * 2048 * 2 / MIB)
    assert send.wire_mib == pytest.approx(4096 * 2048 * 2 / MIB)  # all of it
    assert tr.wire_factor("Receive", 2) == 0.0 and tr.wire_factor("AllGather", 1) == 0.0


def test_operators_sorted_to_the_axis_they_serve(ops):
    par = ParallelConfig(dp=4, tp=2, pp=2, ep=4, micro_batches=2)
    # the last: a weight replicated over the tp ranks, optimizer-sharded over them; its gradient's reduce-scatter
    # is a synchronisation (its instance name), not tensor-parallel traffic
    assert [tr.axis_of(op, 0, par) for op in ops] == ["dp", "dp", "dp", "ep", "tp", "pp", "dp"]
    # with tp 1 a two-rank group is a data-parallel one
    assert tr.axis_of(ops[4], 0, ParallelConfig(dp=2)) == "dp"
    axes = tr.by_axis(ops, 0, par)
    assert set(axes["dp"]) == {"AllGather", "ReduceScatter"} and axes["dp"]["ReduceScatter"]["count"] == 2
    totals = tr.axis_totals(axes)
    assert totals["ep"] == pytest.approx(ops[3].wire_mib * MIB / tr.GIB, rel=1e-4)


def test_against_the_planner_holds_each_axis_to_the_tolerance(ops):
    axes = tr.by_axis(ops, 0, ParallelConfig(dp=4, tp=2, pp=2, ep=4, micro_batches=2))
    compiled = tr.axis_totals(axes)
    exact = {key: compiled[axis] for axis, key in tr.PLANNER_KEYS.items()}
    assert all(row["ok"] for row in tr.against_planner(axes, exact))
    # the planner 20% low on the all-to-all: that axis, and only it, is flagged
    low = dict(exact, ep_alltoall=0.8 * exact["ep_alltoall"])
    flagged = [row["axis"] for row in tr.against_planner(axes, low) if not row["ok"]]
    assert flagged == ["ep"]
    # an axis under FLOOR_SHARE of the rank's traffic (the pipeline send here) is reported, not held
    tiny = dict(exact, pp_p2p=0.0)
    row = next(r for r in tr.against_planner(axes, tiny) if r["axis"] == "pp")
    assert row["planner_gib"] == 0.0 and row["ok"] == (compiled["pp"] < tr.FLOOR_SHARE * sum(compiled.values()))
    lines = tr.format_axes(axes, tr.against_planner(axes, low), "  ")
    assert any("expert all-to-all" in line and "differs by more than 10%" in line for line in lines)
