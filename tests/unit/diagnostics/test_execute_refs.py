"""The executor's stand-ins for primitives without a MindSpore CPU kernel (ms_deepseek.diagnostics.execute_refs),
each against an independent computation: flash attention and its gradient against MindSpore's own autodiff of a
plain softmax attention, SoftmaxBackward against the gradient of ops.softmax, the broadcasting BatchMatMul
against numpy, the custom ops against the package's own CPU Cells."""

import numpy as np
import pytest
from mindspore import Tensor, ops

from ms_deepseek.diagnostics import execute as ex
from ms_deepseek.diagnostics import execute_refs as refs

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


def test_flash_attention_forward_is_causal_softmax_attention():
    q, k, v = _qkv()
    node = ex.Node("o", "FlashAttentionScore", "function", {}, [])
    out = refs.flash_attention(node, [q, k, v, None, None, None, None, None, None, None] + _fa_tail())
    np.testing.assert_allclose(out[3].asnumpy(), _plain_attention(q, k, v).asnumpy(), rtol=1e-5, atol=1e-6)
    # the first query sees only the first key: its output is v's first row
    np.testing.assert_allclose(out[3].asnumpy()[:, :, 0], v.asnumpy()[:, :, 0], rtol=1e-6)


def test_flash_attention_gradient_matches_autodiff():
    import mindspore as ms

    q, k, v = _qkv(1)
    dy = Tensor(np.random.RandomState(2).randn(B, N, S, D).astype(np.float32))
    expected = ms.grad(lambda a, b, c: (_plain_attention(a, b, c) * dy).sum(), grad_position=(0, 1, 2))(q, k, v)
    node = ex.Node("g", "FlashAttentionScoreGrad", "function", {}, [])
    got = refs.flash_attention_grad(node, [q, k, v, dy] + [None] * 11 + _fa_tail())
    for name, a, b in zip(("dq", "dk", "dv"), got[:3], expected):
        np.testing.assert_allclose(a.asnumpy(), b.asnumpy(), rtol=1e-4, atol=1e-5, err_msg=name)


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
