"""The executor's scheduler and collectives (ms_deepseek.verification.execute.executor) on hand-built rank programs.

Each collective is checked against the result written out independently (numpy on the whole tensor), with
ranks of different group orders; the scheduler runs ranks that reach their collectives in different orders,
pairs Send / Receive (a message unlike what its Receive declares is refused), and names both ranks, the field and
both values of a disagreement and every waiting rank of a deadlock instead of hanging.
"""

import re

import numpy as np
import pytest
from mindspore import Tensor
from mindspore.common import dtype as mstype

from ms_deepseek.verification.execute import executor as ex
from ms_deepseek.verification.execute import scheduler as xr


def _node(out, kind, inputs, **attrs):
    return ex.Node(output=out, op=kind, kind="primitive", attrs=attrs, inputs=list(inputs), scope=f"test/{kind}")


def _program(rank, nodes, output):
    return ex.RankProgram(rank, {}, {}, ["x"], nodes, output)


def _run(programs, inputs, world):
    envs = [{"x": Tensor(v)} for v in inputs]
    out = xr.run_ranks(programs, envs, world)
    return {r: (v.asnumpy() if hasattr(v, "asnumpy") else v) for r, v in out.items()}


def test_all_reduce_sum_and_max_over_their_groups():
    rng = np.random.RandomState(0)
    xs = [rng.randn(3, 4).astype(np.float32) for _ in range(4)]
    progs = [
        _program(r, [_node("y", "AllReduce", ["x"], op="sum", group_rank_ids=(r % 2, r % 2 + 2))], "y")
        for r in range(4)
    ]
    out = _run(progs, xs, 4)
    for r in range(4):
        np.testing.assert_allclose(out[r], xs[r % 2] + xs[r % 2 + 2], rtol=1e-6)
    progs = [_program(r, [_node("y", "AllReduce", ["x"], op="max")], "y") for r in range(4)]  # world group
    out = _run(progs, xs, 4)
    np.testing.assert_array_equal(out[3], np.max(np.stack(xs), axis=0))


def test_all_gather_reduce_scatter_and_all_to_all_match_the_whole_tensor():
    rng = np.random.RandomState(1)
    xs = [rng.randn(4, 6).astype(np.float32) for _ in range(2)]
    group = (1, 0)  # group order is not rank order: rank 1 is member 0
    gather = [_program(r, [_node("y", "AllGather", ["x"], group_rank_ids=group)], "y") for r in range(2)]
    out = _run(gather, xs, 2)
    np.testing.assert_array_equal(out[0], np.concatenate([xs[1], xs[0]]))
    scatter = [_program(r, [_node("y", "ReduceScatter", ["x"], op="sum", group_rank_ids=group)], "y") for r in range(2)]
    out = _run(scatter, xs, 2)
    total = xs[0] + xs[1]
    np.testing.assert_allclose(out[1], total[:2], rtol=1e-6)  # member 0 takes the first part
    np.testing.assert_allclose(out[0], total[2:], rtol=1e-6)
    a2a = [
        _program(
            r, [_node("y", "AlltoAll", ["x"], split_dim=1, concat_dim=0, split_count=2, group_rank_ids=(0, 1))], "y"
        )
        for r in range(2)
    ]
    out = _run(a2a, xs, 2)
    # member j receives every member's j-th block of columns, stacked along rows in member order
    for j in range(2):
        np.testing.assert_array_equal(
            out[j], np.concatenate([xs[0][:, 3 * j : 3 * j + 3], xs[1][:, 3 * j : 3 * j + 3]])
        )


def test_ranks_reaching_collectives_in_another_order_and_send_receive_pairs():
    x = [np.full((2,), r + 1.0, np.float32) for r in range(3)]
    # rank 0: AllReduce over (0, 1) then over (0, 2); rank 2 reaches (0, 2) at once; rank 1 sends to rank 2 first
    p0 = _program(
        0,
        [
            _node("a", "AllReduce", ["x"], op="sum", group_rank_ids=(0, 1)),
            _node("b", "AllReduce", ["a"], op="sum", group_rank_ids=(0, 2)),
        ],
        "b",
    )
    p1 = _program(
        1,
        [
            _node("s", "Send", ["x"], sr_tag=7, dest_rank=1, group_rank_ids=(1, 2)),
            _node("a", "AllReduce", ["x"], op="sum", group_rank_ids=(0, 1)),
        ],
        "a",
    )
    p2 = _program(
        2,
        [
            _node("r", "Receive", [], sr_tag=7, src_rank=0, shape=(2,), dtype=mstype.float32, group_rank_ids=(1, 2)),
            _node("b", "AllReduce", ["r"], op="sum", group_rank_ids=(0, 2)),
        ],
        "b",
    )
    out = _run([p0, p1, p2], x, 3)
    np.testing.assert_array_equal(out[1], [3.0, 3.0])  # 1 + 2
    np.testing.assert_array_equal(out[0], [5.0, 5.0])  # (1 + 2) + rank 1's 2 received by rank 2
    np.testing.assert_array_equal(out[2], out[0])


def test_a_rank_that_never_arrives_is_a_named_deadlock_not_a_hang():
    p0 = _program(0, [_node("y", "AllReduce", ["x"], op="sum", group_rank_ids=(0, 1))], "y")
    p1 = _program(1, [], "x")
    with pytest.raises(ex.ExecutionError, match=r"deadlock: rank 0 at AllReduce over \[0, 1\].*finished: ranks \[1\]"):
        _run([p0, p1], [np.ones(2, np.float32)] * 2, 2)


def test_members_that_disagree_on_the_shape_are_named():
    progs = [_program(r, [_node("y", "AllReduce", ["x"], op="sum", group_rank_ids=(0, 1))], "y") for r in range(2)]
    with pytest.raises(
        ex.ExecutionError,
        match=r"ranks 0 and 1 disagree on the shape .*: rank 0 \[2\] \(AllReduce \[2\] float32 at test/AllReduce\), "
        r"rank 1 \[3\]",
    ):
        _run(progs, [np.ones(2, np.float32), np.ones(3, np.float32)], 2)


A2A = {"split_dim": 1, "concat_dim": 0, "split_count": 2}


@pytest.mark.parametrize(
    "kind, field, attrs0, attrs1, shapes, dtypes",
    [
        ("AllReduce", "kind", {"op": "sum"}, {"kind": "AllGather"}, None, None),
        ("AllReduce", "op", {"op": "sum"}, {"op": "max"}, None, None),
        ("ReduceScatter", "op", {"op": "sum"}, {"op": "prod"}, None, None),
        ("AlltoAll", "split_dim", A2A, dict(A2A, split_dim=0), None, None),
        ("AlltoAll", "concat_dim", A2A, dict(A2A, concat_dim=1), None, None),
        ("AlltoAll", "split_count", A2A, dict(A2A, split_count=4), None, None),
        ("AlltoAll", "shape", A2A, A2A, ((4, 4), (4, 8)), None),
        ("AllGather", "dtype", {}, {}, None, (np.float32, np.float16)),
    ],
)
def test_members_that_disagree_on_a_field_are_named(kind, field, attrs0, attrs1, shapes, dtypes):
    """Each field the members of one collective must share, planted on rank 1: both ranks, the field and both values
    are named (the collective used to compute with the first member's attributes)."""
    shapes, dtypes = shapes or ((4, 4), (4, 4)), dtypes or (np.float32, np.float32)
    progs = []
    for r, attrs in enumerate((attrs0, attrs1)):
        attrs = dict(attrs)
        op = attrs.pop("kind", kind)
        progs.append(_program(r, [_node("y", op, ["x"], group_rank_ids=(0, 1), **attrs)], "y"))
    values = {"kind": (kind, "AllGather"), "shape": ([4, 4], [4, 8]), "dtype": ("float32", "float16")}.get(
        field, (attrs0.get(field), attrs1.get(field))
    )
    with pytest.raises(
        ex.ExecutionError,
        match=rf"ranks 0 and 1 disagree on the {field} of their collective over group \[0, 1\]: "
        rf"rank 0 {re.escape(str(values[0]))} .*, rank 1 {re.escape(str(values[1]))} ",
    ):
        _run(progs, [np.ones(s, d) for s, d in zip(shapes, dtypes)], 2)


@pytest.mark.parametrize("declared", [dict(shape=(3,), dtype=mstype.float32), dict(shape=(2,), dtype=mstype.float16)])
def test_a_message_unlike_its_receive_is_refused(declared):
    """Receive declares the buffer it receives into (comm_ops.Receive(sr_tag, src_rank, shape, dtype, group))."""
    send = _program(0, [_node("s", "Send", ["x"], sr_tag=3, dest_rank=1, group_rank_ids=(0, 1))], "x")
    recv = _program(1, [_node("r", "Receive", [], sr_tag=3, src_rank=0, group_rank_ids=(0, 1), **declared)], "r")
    want = f"{list(declared['shape'])} {declared['dtype']}"
    with pytest.raises(
        ex.ExecutionError,
        match=rf"rank 1 received from rank 0 with tag 3 at test/Receive: declared {re.escape(want)}, got \[2\] Float32",
    ):
        _run([send, recv], [np.ones(2, np.float32)] * 2, 2)
    good = _program(
        1,
        [_node("r", "Receive", [], sr_tag=3, src_rank=0, group_rank_ids=(0, 1), shape=(2,), dtype=mstype.float32)],
        "r",
    )
    assert _run([send, good], [np.full(2, 5.0, np.float32)] * 2, 2)[1].tolist() == [5.0, 5.0]


def test_compute_nodes_run_mindspore_kernels_and_scalar_primitives():
    node = ex.Node("y", "Mul", "function", {}, ["x", "x"])
    scalar = ex.Node("z", "ScalarMul", "function", {}, ["n", "n"])
    less = ex.Node("w", "LessScalar", "function", {}, ["x", "two"])
    prog = ex.RankProgram(0, {"n": 3, "two": 2.0}, {}, ["x"], [node, scalar, less], "y")
    env = {"x": Tensor(np.array([1.0, 2.0, 3.0], np.float32))}
    xr.run_ranks([prog], [env], 1)
    np.testing.assert_array_equal(env["y"].asnumpy(), [1.0, 4.0, 9.0])
    assert env["z"] == 9
    np.testing.assert_array_equal(env["w"].asnumpy(), [True, False, False])


def test_a_kernel_failure_names_the_rank_operator_and_scope():
    node = ex.Node("y", "MatMul", "function", {}, ["x", "x", "f", "f"], scope="model/layers.0/MatMul-op3")
    prog = ex.RankProgram(0, {"f": False}, {}, ["x"], [node], "y")
    with pytest.raises(ex.ExecutionError, match=r"rank 0: MatMul at model/layers.0/MatMul-op3 failed on inputs"):
        xr.run_ranks([prog], [{"x": Tensor(np.ones((2, 3), np.float32))}], 1)
