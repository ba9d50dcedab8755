"""The executor's stand-ins for primitives without a MindSpore CPU kernel (ms_deepseek.verification.execute.standins),
each against an independent computation: flash attention and its gradient against MindSpore's own autodiff of a
plain softmax attention, SoftmaxBackward against the gradient of ops.softmax, the broadcasting BatchMatMul
against numpy, the custom ops against the package's own CPU Cells. The flash attention gradient is computed from
the forward statistics it is given and refuses another forward's."""

import numpy as np
import pytest
from mindspore import Tensor, ops
from mindspore.common import dtype as mstype

from ms_deepseek.verification.execute import executor as ex
from ms_deepseek.verification.execute import standins as refs

B, N, S, D = 2, 3, 7, 5
SCALE = 0.37


def _fa_tail(sparse_mode=2, layout=1):
    # head_num, keep_prob, scale_value, pre_tokens, next_tokens, inner_precise, input_layout (BNSD), sparse_mode
    return [N, 1.0, SCALE, 2147483647, 0, 0, layout, sparse_mode]


def _plain_attention(q, k, v):
    """softmax(scale q k^T + causal -inf) v, written with MindSpore ops (its autodiff gives the gradient)."""
    scores = ops.matmul(q, k.swapaxes(-1, -2)) * SCALE
    hidden = Tensor(np.triu(np.ones((S, S), bool), 1))
    scores = ops.masked_fill(scores, hidden, float("-inf"))
    return ops.matmul(ops.softmax(scores, -1), v)


def _qkv(seed=0):
    rng = np.random.RandomState(seed)
    return [Tensor(rng.randn(B, N, S, D).astype(np.float32)) for _ in range(3)]


def _forward(q, k, v):
    node = ex.Node("o", "FlashAttentionScore", "function", {}, [])
    return refs.flash_attention(node, [q, k, v, None, None, None, None, None, None, None] + _fa_tail())


def _grad(q, k, v, dy, forward):
    """FlashAttentionScoreGrad's inputs: q, k, v, dy, pse, drop_mask, padding_mask, atten_mask, softmax_max,
    softmax_sum, softmax_in, attention_in, prefix, actual_seq_qlen, actual_seq_kvlen, the attributes."""
    node = ex.Node("g", "FlashAttentionScoreGrad", "function", {}, [], scope="model/layers.0/attn/FAGrad-op1")
    stats_max, stats_sum, softmax_out, out = forward
    return refs.flash_attention_grad(
        node,
        [q, k, v, dy, None, None, None, None, stats_max, stats_sum, softmax_out, out, None, None, None] + _fa_tail(),
    )


def _numpy_statistics(q, k):
    """The row max of the causal scaled scores and the row sum of exp(scores - max), written out independently."""
    q, k = q.asnumpy().astype(np.float64), k.asnumpy().astype(np.float64)
    row_max, row_sum = np.zeros((B, N, S)), np.zeros((B, N, S))
    for b in range(B):
        for n in range(N):
            for s in range(S):
                scores = [SCALE * float(q[b, n, s] @ k[b, n, t]) for t in range(s + 1)]  # keys 0..s
                row_max[b, n, s] = max(scores)
                row_sum[b, n, s] = sum(np.exp(x - max(scores)) for x in scores)
    return row_max, row_sum


def _numpy_gradient(q, k, v, dy):
    """dq, dk, dv of sum(attention(q, k, v) * dy) with the softmax's Jacobian written out, float64."""
    q, k, v, dy = (t.asnumpy().astype(np.float64) for t in (q, k, v, dy))
    scores = np.einsum("bnsd,bntd->bnst", q, k) * SCALE + np.where(np.triu(np.ones((S, S)), 1) > 0, -np.inf, 0.0)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    dv = np.einsum("bnst,bnsd->bntd", p, dy)
    dp = np.einsum("bnsd,bntd->bnst", dy, v)
    jac = np.einsum("bnst,tu->bnstu", p, np.eye(S)) - np.einsum("bnst,bnsu->bnstu", p, p)  # d p_t / d score_u
    ds = np.einsum("bnst,bnstu->bnsu", dp, jac)
    return np.einsum("bnst,bntd->bnsd", ds, k) * SCALE, np.einsum("bnst,bnsd->bntd", ds, q) * SCALE, dv


def test_flash_attention_forward_is_causal_softmax_attention_with_its_statistics():
    q, k, v = _qkv()
    out = _forward(q, k, v)
    np.testing.assert_allclose(out[3].asnumpy(), _plain_attention(q, k, v).asnumpy(), rtol=1e-5, atol=1e-6)
    # the first query sees only the first key: its output is v's first row
    np.testing.assert_allclose(out[3].asnumpy()[:, :, 0], v.asnumpy()[:, :, 0], rtol=1e-6)
    # softmax_max, softmax_sum: [B, N, S, 8] float32, each row's value repeated 8 times (Ascend's form)
    row_max, row_sum = _numpy_statistics(q, k)
    for got, want in ((out[0], row_max), (out[1], row_sum)):
        assert got.shape == (B, N, S, 8) and got.dtype == mstype.float32
        np.testing.assert_allclose(got.asnumpy(), np.repeat(want[..., None], 8, -1), rtol=1e-6, atol=1e-6)


def test_flash_attention_gradient_matches_autodiff():
    import mindspore as ms

    q, k, v = _qkv(1)
    dy = Tensor(np.random.RandomState(2).randn(B, N, S, D).astype(np.float32))
    expected = ms.grad(lambda a, b, c: (_plain_attention(a, b, c) * dy).sum(), grad_position=(0, 1, 2))(q, k, v)
    got = _grad(q, k, v, dy, _forward(q, k, v))
    for name, a, b in zip(("dq", "dk", "dv"), got[:3], expected):
        np.testing.assert_allclose(a.asnumpy(), b.asnumpy(), rtol=1e-4, atol=1e-5, err_msg=name)


def test_flash_attention_gradient_from_its_own_forward_equals_numpy():
    q, k, v = _qkv(3)
    dy = Tensor(np.random.RandomState(4).randn(B, N, S, D).astype(np.float32))
    got = _grad(q, k, v, dy, _forward(q, k, v))
    for name, a, b in zip(("dq", "dk", "dv"), got[:3], _numpy_gradient(q, k, v, dy)):
        np.testing.assert_allclose(a.asnumpy(), b, rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("swapped", ["softmax_max", "softmax_sum", "attention_in"])
def test_flash_attention_gradient_refuses_another_micro_batchs_forward(swapped):
    """The gradient of one micro-batch given the statistics (or output) of another's forward (other q, k, v)."""
    q, k, v = _qkv(5)
    other = _forward(*_qkv(6))
    dy = Tensor(np.random.RandomState(7).randn(B, N, S, D).astype(np.float32))
    forward = list(_forward(q, k, v))
    forward[{"softmax_max": 0, "softmax_sum": 1, "attention_in": 3}[swapped]] = other[
        {"softmax_max": 0, "softmax_sum": 1, "attention_in": 3}[swapped]
    ]
    with pytest.raises(
        ex.ExecutionError, match=rf"FlashAttentionScoreGrad at model/layers.0/attn/FAGrad-op1: its input {swapped} "
    ):
        _grad(q, k, v, dy, forward)


def test_flash_attention_gradient_uses_the_statistics_it_is_given():
    """Within the tolerance the given statistics are what the gradient is computed from, as on Ascend: the rows'
    sums scaled by 1 + 2^-21 (within the tolerance) scale the gradient by about as much, not by nothing."""
    q, k, v = _qkv(8)
    dy = Tensor(np.random.RandomState(9).randn(B, N, S, D).astype(np.float32))
    forward = list(_forward(q, k, v))
    exact = _grad(q, k, v, dy, forward)
    forward[1] = Tensor((forward[1].asnumpy().astype(np.float64) * (1 + 2.0**-21)).astype(np.float32))
    nudged = _grad(q, k, v, dy, forward)
    dv, dv_nudged = exact[2].asnumpy().astype(np.float64), nudged[2].asnumpy().astype(np.float64)
    assert 0 < np.max(np.abs(dv_nudged - dv)) <= 4 * 2.0**-21 * np.max(np.abs(dv))


def test_flash_attention_outside_the_models_use_is_refused():
    q, k, v = _qkv()
    node = ex.Node("o", "FlashAttentionScore", "function", {}, [])
    with pytest.raises(Exception, match="input_layout BNSD"):
        refs.flash_attention(node, [q, k, v] + [None] * 7 + _fa_tail(layout=0))


def test_softmax_backward_matches_the_gradient_of_softmax():
    import mindspore as ms

    rng = np.random.RandomState(3)
    x = Tensor(rng.randn(4, 9).astype(np.float32))
    dy = Tensor(rng.randn(4, 9).astype(np.float32))
    expected = ms.grad(lambda a: (ops.softmax(a, -1) * dy).sum())(x)
    got = refs.softmax_backward(None, [dy, ops.softmax(x, -1), -1])
    np.testing.assert_allclose(got.asnumpy(), expected.asnumpy(), rtol=1e-5, atol=1e-7)


def test_batch_matmul_broadcasts_the_expert_weights():
    rng = np.random.RandomState(4)
    x = rng.randn(2, 4, 6, 8).astype(np.float32)  # [dp, E, C, H]
    w = rng.randn(4, 5, 8).astype(np.float32)  # [E, I, H], transposed
    got = refs.batch_matmul(None, [Tensor(x), Tensor(w), False, True])
    np.testing.assert_allclose(got.asnumpy(), np.matmul(x, w.swapaxes(-1, -2)), rtol=1e-5, atol=1e-5)


def test_custom_ops_run_the_package_cpu_kernels():
    from mindspore.common import dtype as mstype

    from ms_deepseek.ops import reference

    rng = np.random.RandomState(5)
    x = Tensor(rng.randn(3, 11).astype(np.float32))
    node = ex.Node("y", "Custom", "primitive", {"func_name": "Fp32Softmax"}, [])
    np.testing.assert_allclose(refs.custom(node, [x]).asnumpy(), ops.softmax(x, -1).asnumpy(), rtol=1e-5)
    ids = Tensor(rng.randint(0, 8, (2, 5, 2)).astype(np.int32))  # [G, T, k]
    placement = Tensor(np.stack([np.arange(8) // 4, np.arange(8) % 4], 1).astype(np.int32))  # [E, 2]: rank, slot
    node = ex.Node("y", "Custom", "primitive", {"func_name": "ExpertLookup"}, [])
    got = refs.custom(node, [reference.to_kmajor(ids), placement, 10, 4])
    expected = reference.ExpertLookupReference(8, 4)(ids, placement, 10)
    for a, b in zip(got, expected):
        np.testing.assert_array_equal(reference.from_kmajor(a, 5, 2).asnumpy(), b.asnumpy())
    assert got[0].dtype == mstype.int32
