"""GroupedMatmul (rows sorted by expert, per-expert counts) against numpy: forward and both gradients, the CPU
kernel and the reference, PyNative and graph mode, empty experts and padding rows past the counts' sum."""

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, nn, ops

from ms_deepseek.ops import GroupedMatmul, GroupedSwiglu, build, cpu, reference
from ms_deepseek.ops.api import GroupedSwigluComposed

from tolerances import assert_close_to_scale

ms.set_device("CPU")


def gmm_numpy(x, w, counts):
    """y_e = x_e w_e^T on the experts' row blocks; rows past sum(counts) stay 0."""
    y = np.zeros((x.shape[0], w.shape[1]), np.float64)
    start = 0
    for e, c in enumerate(counts):
        y[start : start + c] = x[start : start + c].astype(np.float64) @ w[e].T.astype(np.float64)
        start += c
    return y


def grads_numpy(x, w, counts, dy):
    dx, dw = np.zeros(x.shape, np.float64), np.zeros(w.shape, np.float64)
    start = 0
    for e, c in enumerate(counts):
        rows = slice(start, start + c)
        dx[rows] = dy[rows].astype(np.float64) @ w[e].astype(np.float64)
        dw[e] = dy[rows].T.astype(np.float64) @ x[rows].astype(np.float64)
        start += c
    return dx, dw


class Loss(nn.Cell):
    def __init__(self, op):
        super().__init__()
        self.op = op

    def construct(self, x, w, g, dy):
        return (self.op(x, w, g) * dy).sum()


CASES = [
    # (counts, rows M): an empty expert, padding rows, one expert holding every row
    ([10, 0, 7, 15, 3], 37),
    ([0, 0, 64, 0], 64),
    ([1, 1, 1, 1, 1, 1], 6),
]


@pytest.fixture(scope="module")
def kernel():
    return cpu.GroupedMatmulCpu(build.build("grouped_matmul"))


@pytest.mark.parametrize("mode", ["pynative", "graph"])
@pytest.mark.parametrize("counts, m", CASES)
@pytest.mark.parametrize("which", ["cpu", "reference"])
def test_forward_and_gradients_match_numpy(kernel, which, counts, m, mode):
    rng = np.random.default_rng(len(counts) * 100 + m)
    k_in, n_out = 24, 40
    x = rng.standard_normal((m, k_in)).astype(np.float32)
    w = rng.standard_normal((len(counts), n_out, k_in)).astype(np.float32)
    dy = rng.standard_normal((m, n_out)).astype(np.float32)
    op = kernel if which == "cpu" else reference.GroupedMatmulReference()
    ms.set_context(mode=ms.GRAPH_MODE if mode == "graph" else ms.PYNATIVE_MODE)
    try:
        args = (Tensor(x), Tensor(w), Tensor(np.array(counts, np.int32)))
        y = op(*args).asnumpy()
        dx, dw = ops.GradOperation(get_all=True)(Loss(op))(*args, Tensor(dy))[:2]
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)
    want = gmm_numpy(x, w, counts)
    want_dx, want_dw = grads_numpy(x, w, counts, dy)
    # each output sums k_in (forward, dw: rows of one expert) or n_out (dx) float32 products
    assert_close_to_scale(y, want, terms=k_in, err_msg="y")
    assert_close_to_scale(dx.asnumpy(), want_dx, terms=n_out, err_msg="dx")
    assert_close_to_scale(dw.asnumpy(), want_dw, terms=max(counts), err_msg="dw")
    assert not y[sum(counts) :].any()  # padding rows


def test_public_cell_picks_the_cpu_kernel_and_refuses_bad_counts(kernel):
    assert GroupedMatmul().impl.kind == "cpu"
    x, w = Tensor(np.ones((4, 3), np.float32)), Tensor(np.ones((2, 5, 3), np.float32))
    with pytest.raises(RuntimeError):
        kernel(x, w, Tensor(np.array([3, 2], np.int32))).asnumpy()  # 5 rows counted, 4 held


def test_reference_forced_by_the_switch(monkeypatch):
    monkeypatch.setenv("MS_DEEPSEEK_OPS", "reference")
    assert GroupedMatmul().impl.kind == "reference"


class SwigluLoss(nn.Cell):
    def __init__(self, op):
        super().__init__()
        self.op = op

    def construct(self, tokens, order, wg, wu, wd, g, weight, dy):
        return (self.op(tokens, order, wg, wu, wd, g, weight) * dy).sum()


@pytest.mark.parametrize("mode", ["pynative", "graph"])
@pytest.mark.parametrize("counts, k", [([10, 0, 7, 15, 4], 2), ([0, 0, 36, 0], 3)])
def test_fused_swiglu_matches_the_composed_one(counts, k, mode):
    """GroupedSwiglu's CPU kernel (gather, experts and the weighted way back in one call; its gradient in one more)
    against gathers, three GroupedMatmul calls, SiLU and the weighted sum, on a random routing of N tokens' k
    choices."""
    rng = np.random.default_rng(k)
    s, h, i, e = sum(counts), 24, 40, len(counts)
    n = s // k
    experts = np.repeat(np.arange(e), counts)  # the sorted rows' experts
    order = rng.permutation(s).astype(np.int32)  # the slot at each sorted position
    tokens = rng.standard_normal((n, h)).astype(np.float32)
    wg, wu = (rng.standard_normal((e, i, h)).astype(np.float32) * 0.3 for _ in range(2))
    wd = rng.standard_normal((e, h, i)).astype(np.float32) * 0.3
    weight = rng.uniform(0.1, 1.0, (n, k)).astype(np.float32)  # the routing weights
    dy = rng.standard_normal((n, h)).astype(np.float32)
    g = np.array(counts, np.int32)
    args = [Tensor(a) for a in (tokens, order, wg, wu, wd, g, weight, dy)]
    fused, composed = GroupedSwiglu(), GroupedSwigluComposed()
    assert fused.impl.kind == "cpu"
    ms.set_context(mode=ms.GRAPH_MODE if mode == "graph" else ms.PYNATIVE_MODE)
    try:
        grads = ops.GradOperation(get_all=True)
        got = [fused(*args[:7]).asnumpy()] + [t.asnumpy() for t in grads(SwigluLoss(fused))(*args)]
        want = [composed(*args[:7]).asnumpy()] + [t.asnumpy() for t in grads(SwigluLoss(composed))(*args)]
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)
    names = ("out", "dtokens", "dorder", "dw_gate", "dw_up", "dw_down", "dgroup_list", "dweight")
    for name, a, b in zip(names, got, want):
        if name not in ("dorder", "dgroup_list"):
            assert_close_to_scale(a, b, terms=max(h, i, max(counts), k), err_msg=name)
    # a token's output is the weighted sum of its k slots' expert MLPs on it (numpy, float64)
    token = int(order[5]) // k
    position = np.argsort(order)  # the sorted position of each slot
    x = tokens[token].astype(np.float64)
    want_row = np.zeros(h)
    for j in range(k):
        ex = experts[position[token * k + j]]
        gate, up = wg[ex] @ x, wu[ex] @ x
        want_row += weight[token, j] * (wd[ex] @ (gate / (1 + np.exp(-gate)) * up))
    assert_close_to_scale(got[0][token], want_row, terms=max(h, i) * k, err_msg="one token against numpy")
