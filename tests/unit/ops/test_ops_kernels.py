"""CPU kernels of the custom operators against numpy ground truth and the references.

Covers random and edge inputs (duplicate ids, empty prefix, all dropped,
capacity exactly full, extreme logits, -inf entries), every softmax input dtype,
gradients, PyNative and graph mode (ms.jit), and shrunken core / UB settings that
force tail tiles and the column-tile softmax path.
"""

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, nn
from mindspore.common import dtype as mstype

from ms_deepseek.ops import ExpertLookup, FP32Softmax, RepetitionPenalty, build, cpu, reference
from ms_deepseek.ops.tiling import tiling

from tolerances import assert_close_to_scale

ms.set_device("CPU")

# Schedules: (core_num, ub_bytes). The default is the 910B; the others force
# tails, single cores and the column-tile softmax path on small shapes.
SCHEDULES = [(48, 196352), (3, 4096), (1, 4608)]


@pytest.fixture(scope="module")
def libs():
    return {op: build.build(op) for op in ("expert_lookup", "fp32_softmax", "repetition_penalty")}


# --------------------------------------------------------------------------- numpy truth


def lookup_numpy(ids, placement, experts_per_rank, capacity):
    """ids [G, T, k] (or [T, k]); positions count per group; ids outside [0, E) -> (-1, -1, -1, 0)."""
    if ids.ndim == 2:
        return tuple(o[0] for o in lookup_numpy(ids[None], placement, experts_per_rank, capacity))
    g, t, k = ids.shape
    num_experts = placement.shape[0]
    dest, row, position = (np.full_like(ids, -1) for _ in range(3))
    keep = np.zeros(ids.shape, np.float32)
    for grp in range(g):
        counts = {}
        for j in range(k):  # k-major: all first choices in token order, then all second choices, ...
            for i in range(t):
                e = int(ids[grp, i, j])
                if not 0 <= e < num_experts:
                    continue
                position[grp, i, j] = counts.get(e, 0)
                counts[e] = position[grp, i, j] + 1
                dest[grp, i, j] = placement[e, 0]
                row[grp, i, j] = placement[e, 0] * experts_per_rank + placement[e, 1]
                keep[grp, i, j] = float(position[grp, i, j] < capacity)
    return dest, row, position, keep


def softmax64(x):
    x = np.asarray(x, np.float64)
    m = x.max(axis=-1, keepdims=True)
    e = np.exp(x - m)
    return e / e.sum(axis=-1, keepdims=True)


def penalty_numpy(logits, ids, penalty):
    """Ids outside [0, V) change nothing."""
    out = logits.copy()
    for b in range(ids.shape[0]):
        for i in set(ids[b].tolist()) & set(range(logits.shape[1])):
            v = logits[b, i]
            out[b, i] = v * np.float32(penalty) if v < 0 else v / np.float32(penalty)
    return out


def random_placement(rng, num_experts, experts_per_rank):
    perm = rng.permutation(num_experts)  # expert perm[i] sits at rank i // E_local, slot i % E_local
    placement = np.zeros((num_experts, 2), np.int32)
    placement[perm, 0] = np.arange(num_experts) // experts_per_rank
    placement[perm, 1] = np.arange(num_experts) % experts_per_rank
    return placement


# --------------------------------------------------------------------------- ExpertLookup

LOOKUP_CASES = {
    # name: (G, T, k, E, E_local, capacity, id generator)
    "random": (1, 37, 3, 8, 2, 15, lambda rng, g, t, k, e: rng.integers(0, e, (g, t, k))),
    "groups": (4, 13, 3, 8, 2, 4, lambda rng, g, t, k, e: rng.integers(0, e, (g, t, k))),
    "all_dropped": (2, 9, 2, 4, 4, 0, lambda rng, g, t, k, e: rng.integers(0, e, (g, t, k))),
    "one_expert_exactly_full": (1, 6, 2, 4, 1, 12, lambda rng, g, t, k, e: np.full((g, t, k), 3)),
    "one_expert_one_over": (3, 6, 2, 4, 1, 11, lambda rng, g, t, k, e: np.full((g, t, k), 3)),
    "single_token": (1, 1, 6, 64, 8, 1, lambda rng, g, t, k, e: rng.permutation(e)[:k].reshape(1, 1, k)),
    "many_slots": (1, 301, 6, 160, 20, 12, lambda rng, g, t, k, e: rng.integers(0, e, (g, t, k))),
    "out_of_range": (3, 11, 2, 8, 4, 3, lambda rng, g, t, k, e: rng.integers(-3, e + 3, (g, t, k))),
}


@pytest.mark.parametrize("schedule", SCHEDULES, ids=lambda s: f"cores{s[0]}_ub{s[1]}")
@pytest.mark.parametrize("case", sorted(LOOKUP_CASES))
def test_expert_lookup_cpu_matches_numpy_and_reference(libs, case, schedule):
    g, t, k, e, e_local, capacity, gen = LOOKUP_CASES[case]
    rng = np.random.default_rng(len(case))
    ids = gen(rng, g, t, k, e).astype(np.int32)
    placement = random_placement(rng, e, e_local)
    kernel = cpu.ExpertLookupCpu(libs["expert_lookup"], e, e_local, core_num=schedule[0], ub_bytes=schedule[1])
    got = [o.asnumpy() for o in kernel(Tensor(ids), Tensor(placement), capacity)]
    want = lookup_numpy(ids, placement, e_local, capacity)
    ref = [o.asnumpy() for o in reference.ExpertLookupReference(e, e_local)(Tensor(ids), Tensor(placement), capacity)]
    for name, g, w, r in zip(("dest_rank", "buffer_row", "position", "keep"), got, want, ref):
        assert g.dtype == (np.float32 if name == "keep" else np.int32), name
        np.testing.assert_array_equal(g, w, err_msg=name)
        np.testing.assert_array_equal(r, w, err_msg=f"reference {name}")


def test_expert_lookup_first_choice_dropped_last(libs):
    # With capacity 3, all five first choices fit (expert 0 gets 3, expert 1 gets 2);
    # of the second choices only token 0's (third slot of expert 1) still fits.
    ids = np.array([[0, 1], [0, 1], [1, 0], [0, 1], [1, 0]], np.int32)
    placement = np.array([[0, 0], [0, 1]], np.int32)
    _, _, pos, keep = ExpertLookup(2, 2)(Tensor(ids), Tensor(placement), 3)
    # expert 0 first choices: tokens 0, 1, 3 -> positions 0..2; then second choices of tokens 2, 4 -> 3, 4
    np.testing.assert_array_equal(pos.asnumpy()[:, 0], [0, 1, 0, 2, 1])
    np.testing.assert_array_equal(keep.asnumpy(), [[1, 1], [1, 0], [1, 0], [1, 0], [1, 0]])


def test_expert_lookup_out_of_range_ids_are_inert(libs):
    # Ids outside [0, E) are not counted (the next valid slot of expert 0 still gets position 1)
    # and come out as (-1, -1, -1, 0): same on the CPU kernel and the reference.
    ids = np.array([[[0, 7], [-1, 0], [4, 1]]], np.int32)  # [G=1, T=3, k=2], E = 4
    placement = random_placement(np.random.default_rng(0), 4, 2)
    want = lookup_numpy(ids, placement, 2, 2)
    np.testing.assert_array_equal(want[2], [[[0, -1], [-1, 1], [-1, 0]]])
    for impl in (cpu.ExpertLookupCpu(libs["expert_lookup"], 4, 2), reference.ExpertLookupReference(4, 2)):
        got = [o.asnumpy() for o in impl(Tensor(ids), Tensor(placement), 2)]
        for name, g, w in zip(("dest_rank", "buffer_row", "position", "keep"), got, want):
            np.testing.assert_array_equal(g, w, err_msg=f"{impl.kind} {name}")


@pytest.mark.parametrize("mode", [ms.PYNATIVE_MODE, ms.GRAPH_MODE])
def test_expert_lookup_one_group_equals_its_row_of_all_groups(libs, mode):
    # What one device computes under the strategy ((dp, 1), (1, 1)): its own group only.
    rng = np.random.default_rng(3)
    g, t, k, e, e_local, capacity = 4, 17, 2, 8, 2, 5
    ids = rng.integers(0, e, (g, t, k)).astype(np.int32)
    placement = random_placement(rng, e, e_local)
    old = ms.get_context("mode")
    ms.set_context(mode=mode)
    try:
        kernel = cpu.ExpertLookupCpu(libs["expert_lookup"], e, e_local)
        full = [o.asnumpy() for o in kernel(Tensor(ids), Tensor(placement), capacity)]
        for grp in range(g):
            one = [o.asnumpy() for o in kernel(Tensor(ids[grp : grp + 1]), Tensor(placement), capacity)]
            for a, b in zip(one, full):
                np.testing.assert_array_equal(a[0], b[grp])
    finally:
        ms.set_context(mode=old)


# --------------------------------------------------------------------------- FP32Softmax


def to_dtype(x, dtype):
    return Tensor(x.astype(np.float32)).astype(dtype)


@pytest.mark.parametrize("schedule", SCHEDULES, ids=lambda s: f"cores{s[0]}_ub{s[1]}")
@pytest.mark.parametrize("dtype", [mstype.float32, mstype.float16, mstype.bfloat16], ids=str)
def test_softmax_cpu_accuracy(libs, dtype, schedule):
    rng = np.random.default_rng(1)
    x = to_dtype(rng.standard_normal((3, 5, 203)) * 6, dtype)  # 203: not a multiple of 8 or 16
    y = cpu.FP32SoftmaxCpu(libs["fp32_softmax"], core_num=schedule[0], ub_bytes=schedule[1])(x).asnumpy()
    want = softmax64(x.astype(mstype.float32).asnumpy())
    assert y.dtype == np.float32
    rel = np.abs(y - want) / want
    assert rel.max() < 1.2e-7, rel.max()  # one rounding to float32 (0.5 ulp = 6e-8) plus double error


def test_softmax_cpu_more_accurate_than_mindspore_builtin(libs):
    """The kernel's relative error vs float64 is ~6e-8; MindSpore's CPU Softmax is worse."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((64, 512)).astype(np.float32) * 8
    want = softmax64(x)
    ours = cpu.FP32SoftmaxCpu(libs["fp32_softmax"])(Tensor(x)).asnumpy()
    builtin = ms.ops.softmax(Tensor(x), axis=-1).asnumpy()
    ours_rel = (np.abs(ours - want) / want).max()
    builtin_rel = (np.abs(builtin - want) / want).max()
    print(f"softmax max relative error vs float64: kernel {ours_rel:.2e}, mindspore {builtin_rel:.2e}")
    assert ours_rel < 1.2e-7
    assert ours_rel < builtin_rel


@pytest.mark.parametrize("schedule", SCHEDULES[1:], ids=lambda s: f"cores{s[0]}_ub{s[1]}")
def test_softmax_cpu_extreme_and_masked_inputs(libs, schedule):
    x = np.array(
        [
            [1e4, -1e4, 0.0, 1e4 - 1.0, 3.0],
            [-np.inf, 0.5, -np.inf, 1.5, -np.inf],  # causal-mask style: partially -inf
            [-1e4, -1e4, -1e4, -1e4, -1e4],
            [65504.0, -65504.0, 0.0, 1.0, 2.0],
        ],
        np.float32,
    )
    y = cpu.FP32SoftmaxCpu(libs["fp32_softmax"], core_num=schedule[0], ub_bytes=schedule[1])(Tensor(x)).asnumpy()
    want = softmax64(x)
    np.testing.assert_allclose(y, want, rtol=1.2e-7, atol=1e-30)
    assert (y[1, [0, 2, 4]] == 0).all()
    ref = reference.FP32SoftmaxReference()(Tensor(x)).asnumpy()
    np.testing.assert_allclose(ref, want, rtol=1e-5, atol=1e-30)


def test_softmax_cpu_column_tiles_masked_whole_tiles(libs):
    """Column-tile mode (a row longer than UB) with whole tiles of -inf, as a causal mask over a long
    row gives: those tiles add nothing to the sum (not exp(-inf + inf) = NaN)."""
    x = np.random.default_rng(8).standard_normal((3, 400)).astype(np.float32)
    x[:, :250] = -np.inf
    x[1, 300:] = -np.inf
    impl = cpu.FP32SoftmaxCpu(libs["fp32_softmax"], core_num=3, ub_bytes=4096)
    assert tiling("fp32_softmax", rows=3, cols=400, in_bytes=4, num_inputs=1, core_num=3, ub_bytes=4096)["mode"] == 1
    y = impl(Tensor(x)).asnumpy()
    np.testing.assert_allclose(y, softmax64(x), rtol=2e-7, atol=0)


def test_softmax_cpu_nan_and_all_masked_rows_match_reference(libs):
    x = np.array([[-np.inf, -np.inf, -np.inf], [0.0, np.nan, 1.0], [0.0, 1.0, 2.0]], np.float32)
    y = cpu.FP32SoftmaxCpu(libs["fp32_softmax"])(Tensor(x)).asnumpy()
    ref = reference.FP32SoftmaxReference()(Tensor(x)).asnumpy()
    assert np.isnan(y[:2]).all() and np.isnan(ref[:2]).all()
    np.testing.assert_allclose(y[2], softmax64(x[2]), rtol=1.2e-7)
    np.testing.assert_allclose(y[2], ref[2], rtol=1e-5)  # MindSpore's Exp is the less accurate one


@pytest.mark.parametrize("shape", [(0, 7), (3, 0), (2, 0, 5)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [mstype.float32, mstype.bfloat16], ids=str)
def test_softmax_cpu_empty_input(libs, shape, dtype):
    """No rows or no columns: no core and no tile in the schedule (the Ascend kernel returns before
    Init for it), an empty float32 result, in PyNative and graph mode."""
    rows, cols = int(np.prod(shape[:-1])), shape[-1]
    t = tiling("fp32_softmax", rows=rows, cols=cols, in_bytes=4, num_inputs=1)
    assert t["used_cores"] == 0 and t["rows_per_tile"] == 0 and t["col_tiles"] == 0
    kernel = cpu.FP32SoftmaxCpu(libs["fp32_softmax"])
    x = Tensor(np.zeros(shape, np.float32)).astype(dtype)
    for run in (kernel, ms.jit(kernel.construct)):
        y = run(x)
        assert y.shape == shape and y.dtype == mstype.float32


@pytest.mark.parametrize("out_dtype", [mstype.float32, mstype.float16, mstype.bfloat16], ids=str)
def test_softmax_out_dtype(out_dtype):
    x = Tensor(np.random.default_rng(3).standard_normal((4, 7)).astype(np.float32))
    y = FP32Softmax(out_dtype=out_dtype)(x)
    assert y.dtype == out_dtype
    np.testing.assert_allclose(y.astype(mstype.float32).asnumpy(), softmax64(x.asnumpy()), rtol=1e-2)


class _WeightedSoftmaxLoss(nn.Cell):
    def __init__(self, softmax):
        super().__init__()
        self.softmax = softmax

    def construct(self, x, w):
        return (self.softmax(x).astype(mstype.float32) * w).sum()


def _softmax_grad64(x, w):
    y = softmax64(x)
    return y * (w - (w * y).sum(axis=-1, keepdims=True))


@pytest.mark.parametrize("schedule", SCHEDULES[::2], ids=lambda s: f"cores{s[0]}_ub{s[1]}")
def test_softmax_cpu_gradient(libs, schedule):
    rng = np.random.default_rng(4)
    x = rng.standard_normal((6, 45)).astype(np.float32) * 3
    w = rng.standard_normal((6, 45)).astype(np.float32)
    kernel = cpu.FP32SoftmaxCpu(libs["fp32_softmax"], core_num=schedule[0], ub_bytes=schedule[1])
    grad = ms.grad(_WeightedSoftmaxLoss(kernel), grad_position=0)(Tensor(x), Tensor(w)).asnumpy()
    want = _softmax_grad64(x, w)
    np.testing.assert_allclose(grad, want, rtol=1e-6, atol=1e-7)
    ref = ms.grad(_WeightedSoftmaxLoss(reference.FP32SoftmaxReference()), grad_position=0)(Tensor(x), Tensor(w))
    np.testing.assert_allclose(grad, ref.asnumpy(), rtol=1e-4, atol=1e-6)
    # Central differences in float64 on the kernel's own forward (a few entries). They differ from the derivative
    # by h^2 |f'''| / 6: along one logit the weighted sum is m + (w_j - m) s, m the other weights' softmax-weighted
    # mean and s a logistic function (|s'''| <= 1/8), so |f'''| <= max|w| / 4; and from the float32 gradient by
    # its rounding (4 ulps of its largest entry).
    eps = 1e-3
    allowance = eps**2 * np.abs(w).max() + 4 * np.finfo(np.float32).eps * np.abs(grad).max()
    for i, j in [(0, 0), (2, 17), (5, 44)]:
        xp, xm = x.astype(np.float64).copy(), x.astype(np.float64).copy()
        xp[i, j] += eps
        xm[i, j] -= eps
        fp = (softmax64(xp) * w).sum()
        fm = (softmax64(xm) * w).sum()
        assert abs((fp - fm) / (2 * eps) - grad[i, j]) <= allowance, (i, j)


@pytest.mark.parametrize("dtype", [mstype.float16, mstype.bfloat16], ids=str)
def test_softmax_cpu_gradient_low_precision_input(libs, dtype):
    rng = np.random.default_rng(5)
    x = to_dtype(rng.standard_normal((3, 20)), dtype)
    w = Tensor(rng.standard_normal((3, 20)).astype(np.float32))
    grad = ms.grad(_WeightedSoftmaxLoss(cpu.FP32SoftmaxCpu(libs["fp32_softmax"])), grad_position=0)(x, w)
    assert grad.dtype == dtype
    want = _softmax_grad64(x.astype(mstype.float32).asnumpy(), w.asnumpy())
    low = "bfloat16" if dtype == mstype.bfloat16 else np.float16
    assert_close_to_scale(grad.astype(mstype.float32).asnumpy(), want, ulps=2, dtype=low)


# --------------------------------------------------------------------------- RepetitionPenalty

PENALTY_CASES = {
    # name: (B, V, L, penalty)
    "random": (3, 97, 11, 1.3),
    "duplicates": (2, 40, 30, 2.0),  # L close to V: many repeated ids
    "below_one": (2, 33, 5, 0.5),  # penalty < 1 boosts
    "long_prefix": (1, 50, 200, 1.7),
    # rows longer than a tile on the small-UB schedules: a row segment spans several tiles, its ids
    # loaded once (L = 100) or streamed for every tile (L = 400 > id_tile)
    "wide_rows": (2, 2000, 100, 1.3),
    "wide_rows_long_prefix": (2, 2000, 400, 0.8),
}


@pytest.mark.parametrize("schedule", SCHEDULES, ids=lambda s: f"cores{s[0]}_ub{s[1]}")
@pytest.mark.parametrize("case", sorted(PENALTY_CASES))
def test_repetition_penalty_cpu(libs, case, schedule):
    b, v, length, penalty = PENALTY_CASES[case]
    rng = np.random.default_rng(len(case))
    logits = (rng.standard_normal((b, v)) * 5).astype(np.float32)
    logits[0, :3] = [0.0, -0.0, 1e-30]
    ids = rng.integers(0, v, (b, length)).astype(np.int32)
    ids[0, :3] = [0, 1, 2]
    kernel = cpu.RepetitionPenaltyCpu(libs["repetition_penalty"], core_num=schedule[0], ub_bytes=schedule[1])
    got = kernel(Tensor(logits), Tensor(ids), penalty).asnumpy()
    want = penalty_numpy(logits, ids, penalty)
    np.testing.assert_array_equal(got, want)
    ref = reference.RepetitionPenaltyReference()(Tensor(logits), Tensor(ids), penalty).asnumpy()
    np.testing.assert_array_equal(ref, want)


def test_repetition_penalty_public_api_empty_prefix_and_int64_ids():
    logits = Tensor(np.arange(-3, 5, dtype=np.float32).reshape(2, 4))
    out = RepetitionPenalty()(logits, Tensor(np.zeros((2, 0), np.int32)), 1.5)
    np.testing.assert_array_equal(out.asnumpy(), logits.asnumpy())
    out = RepetitionPenalty()(logits, Tensor(np.array([[0, 0], [3, 1]], np.int64)), 2)
    np.testing.assert_array_equal(out.asnumpy(), [[-6, -2, -1, 0], [1, 1, 3, 2]])


class _PenaltyInGraph(nn.Cell):
    """The public Cell inside another Cell's construct: no host-side id check runs."""

    def __init__(self, penalty):
        super().__init__()
        self.op = RepetitionPenalty()
        self.penalty = penalty

    def construct(self, logits, ids):
        return self.op(logits, ids, self.penalty)


# V = 37. In the flat [B * V] logits, row 0's id V + 2 is row 1's element 2, row 1's -1 is row 0's
# last element, row 1's 2 * V + 1 lies in row 3 (past the tensor); none may change anything.
OUT_OF_RANGE_IDS = [[37 + 2, 5, -1, 5], [2 * 37 + 1, -37, 0, 36], [-1, -1, -1, -1]]


@pytest.mark.parametrize("mode", [ms.PYNATIVE_MODE, ms.GRAPH_MODE])
def test_repetition_penalty_ignores_out_of_range_ids(libs, mode):
    rng = np.random.default_rng(11)
    logits = (rng.standard_normal((3, 37)) * 4).astype(np.float32)
    ids = np.array(OUT_OF_RANGE_IDS, np.int32)
    want = penalty_numpy(logits, ids, 1.5)
    changed = np.argwhere(want != logits).tolist()
    assert changed == [[0, 5], [1, 0], [1, 36]], changed  # only the in-range ids of each row
    impls = [cpu.RepetitionPenaltyCpu(libs["repetition_penalty"], core_num=c, ub_bytes=u) for c, u in SCHEDULES]
    impls.append(reference.RepetitionPenaltyReference())
    old = ms.get_context("mode")
    ms.set_context(mode=mode)
    try:
        for impl in impls:
            got = impl(Tensor(logits), Tensor(ids), 1.5).asnumpy()
            np.testing.assert_array_equal(got, want, err_msg=impl.kind)
        net = _PenaltyInGraph(1.5)
        assert net.op.impl.kind == "cpu"
        got = (ms.jit(net.construct) if mode == ms.PYNATIVE_MODE else net)(Tensor(logits), Tensor(ids))
        np.testing.assert_array_equal(got.asnumpy(), want)
    finally:
        ms.set_context(mode=old)


# --------------------------------------------------------------------------- graph mode


class _RouterStep(nn.Cell):
    """Softmax -> ExpertLookup inside one compiled graph, with the softmax gradient."""

    def __init__(self, num_experts, experts_per_rank, capacity):
        super().__init__()
        self.softmax = FP32Softmax()
        self.lookup = ExpertLookup(num_experts, experts_per_rank)
        self.capacity = capacity

    def construct(self, scores, topk_ids, placement, w):
        probs = self.softmax(scores)
        dest, row, pos, keep = self.lookup(topk_ids, placement, self.capacity)
        loss = (probs * w).sum() + (keep * 0.0).sum()
        return loss, dest, row, pos, keep


def test_graph_mode_kernels_match_pynative():
    rng = np.random.default_rng(6)
    t, k, e, e_local, capacity = 23, 2, 8, 4, 5
    scores = rng.standard_normal((t, e)).astype(np.float32)
    ids = rng.integers(0, e, (t, k)).astype(np.int32)
    placement = random_placement(rng, e, e_local)
    w = rng.standard_normal((t, e)).astype(np.float32)
    net = _RouterStep(e, e_local, capacity)
    assert net.softmax.impl.kind == "cpu" and net.lookup.impl.kind == "cpu"
    args = (Tensor(scores), Tensor(ids), Tensor(placement), Tensor(w))
    eager_out = net(*args)
    eager_grad = ms.grad(net, grad_position=0)(*args)
    graph_fn = ms.jit(net.construct)
    graph_out = graph_fn(*args)
    graph_grad = ms.jit(ms.grad(net, grad_position=0))(*args)
    for a, b in zip(graph_out, eager_out):
        np.testing.assert_array_equal(a.asnumpy(), b.asnumpy())
    np.testing.assert_allclose(graph_grad.asnumpy(), eager_grad.asnumpy(), rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(graph_grad.asnumpy(), _softmax_grad64(scores, w), rtol=1e-6, atol=1e-7)
    want = lookup_numpy(ids, placement, e_local, capacity)
    for got, expected in zip(graph_out[1:], want):
        np.testing.assert_array_equal(got.asnumpy(), expected)


def test_graph_mode_context_with_custom_ops():
    """GRAPH_MODE set globally (as the trainer does), not only ms.jit."""
    rng = np.random.default_rng(7)
    scores = rng.standard_normal((10, 4)).astype(np.float32)
    ids = rng.integers(0, 4, (10, 2)).astype(np.int32)
    placement = random_placement(rng, 4, 2)
    w = np.ones((10, 4), np.float32)
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        net = _RouterStep(4, 2, 3)
        loss, _, _, pos, keep = net(Tensor(scores), Tensor(ids), Tensor(placement), Tensor(w))
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)
    np.testing.assert_allclose(float(loss.asnumpy()), 10.0, rtol=1e-6)  # rows of softmax sum to 1
    want = lookup_numpy(ids, placement, 2, 3)
    np.testing.assert_array_equal(pos.asnumpy(), want[2])
    np.testing.assert_array_equal(keep.asnumpy(), want[3])
