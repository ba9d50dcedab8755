"""Ascend C kernels on an NPU: build with CANN, install, run against the references.

Skipped on hosts without an Ascend device and CANN (conftest's ``ascend`` marker).
The build takes minutes; it runs once per module into a temporary install path.

MindSpore accepts ``set_device`` once per process (design.md), and other test modules
run on CPU first, so ``test_npu_kernels_in_their_own_process`` re-runs this module in a
fresh interpreter with ``MS_DEEPSEEK_NPU_CHILD=1``; only there do the kernel tests run
(and call ``set_device("Ascend")``, never switching back).
"""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from npu_cases import PENALTY_IDS_STREAMED, SOFTMAX_SHORT_LAST_TILE
from repo_paths import REPO

pytestmark = pytest.mark.ascend

CHILD = os.environ.get("MS_DEEPSEEK_NPU_CHILD") == "1"
in_child = pytest.mark.skipif(
    not CHILD,
    reason="runs in the subprocess started by test_npu_kernels_in_their_own_process (set_device once per process)",
)


@pytest.mark.skipif(CHILD, reason="this is the child process")
def test_npu_kernels_in_their_own_process(tmp_path):
    env = dict(os.environ, MS_DEEPSEEK_NPU_CHILD="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(__file__))],
        capture_output=True,
        text=True,
        timeout=3600,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and " failed" not in proc.stdout


@pytest.fixture(scope="module")
def ascend_ops(tmp_path_factory):
    install = tmp_path_factory.mktemp("ascend_opp")
    proc = subprocess.run(
        ["bash", str(REPO / "ops" / "build_ascend.sh"), "--install-path", str(install)],
        capture_output=True,
        text=True,
        timeout=3600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    vendor = install / "vendors" / "ms_deepseek"
    assert vendor.is_dir(), f"no vendor folder in {install}"
    old = os.environ.get("ASCEND_CUSTOM_OPP_PATH", "")
    os.environ["ASCEND_CUSTOM_OPP_PATH"] = f"{vendor}:{old}" if old else str(vendor)

    import mindspore as ms

    ms.set_device("Ascend")  # this process's only set_device (the child started above)
    from ms_deepseek.ops import ascend

    assert {"ExpertLookup", "Fp32Softmax", "RepetitionPenalty"} <= ascend.installed_op_types()
    yield ascend
    os.environ["ASCEND_CUSTOM_OPP_PATH"] = old


def _softmax64(x):
    x = np.asarray(x, np.float64)
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _lookup_numpy(ids, placement, experts_per_rank, capacity):
    """ids [G, T, k]: positions per group in k-major order; ids outside [0, E) -> (-1, -1, -1, 0)."""
    g, t, k = ids.shape
    dest, row, position = (np.full_like(ids, -1) for _ in range(3))
    keep = np.zeros(ids.shape, np.float32)
    for grp in range(g):
        counts = {}
        for j in range(k):
            for i in range(t):
                e = int(ids[grp, i, j])
                if not 0 <= e < placement.shape[0]:
                    continue
                position[grp, i, j] = counts.get(e, 0)
                counts[e] = position[grp, i, j] + 1
                dest[grp, i, j] = placement[e, 0]
                row[grp, i, j] = placement[e, 0] * experts_per_rank + placement[e, 1]
                keep[grp, i, j] = float(position[grp, i, j] < capacity)
    return dest, row, position, keep


@in_child
# (2, 100003) uses column tiles; SOFTMAX_SHORT_LAST_TILE reach a row tile shorter than rows_per_tile,
# where the SoftMax API re-derives its split on the device (tests/helpers/npu_cases.py)
@pytest.mark.parametrize(
    "shape", [(4, 7), (3, 64, 203), (2, 100003), *SOFTMAX_SHORT_LAST_TILE], ids=lambda s: "x".join(map(str, s))
)
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_fp32_softmax_on_npu(ascend_ops, shape, dtype):
    import mindspore as ms
    from mindspore import Tensor

    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32) * 4
    xt = Tensor(x).astype(getattr(ms, dtype))
    cell = ascend_ops.FP32SoftmaxAscend()
    y = cell(xt).asnumpy()
    want = _softmax64(xt.astype(ms.float32).asnumpy())
    np.testing.assert_allclose(y, want, rtol=2e-5, atol=1e-9)


@in_child
@pytest.mark.parametrize("shape", [(0, 7), (3, 0)], ids=lambda s: "x".join(map(str, s)))
def test_fp32_softmax_empty_on_npu(ascend_ops, shape):
    """No rows or no columns: the kernel returns before Init (no zero-length InitBuffer)."""
    import mindspore as ms
    from mindspore import Tensor

    y = ascend_ops.FP32SoftmaxAscend()(Tensor(np.zeros(shape, np.float32))).asnumpy()
    assert y.shape == shape and y.dtype == np.float32
    assert ms.get_context("device_target") == "Ascend"


@in_child
@pytest.mark.parametrize("cols", [4096, 100003])  # whole rows (SoftMax API), column tiles
def test_fp32_softmax_masked_rows_on_npu(ascend_ops, cols):
    """Causal-mask style -inf stretches, whole column tiles of them in the long rows."""
    from mindspore import Tensor

    x = np.random.default_rng(4).standard_normal((3, cols)).astype(np.float32) * 4
    x[:, : cols * 3 // 5] = -np.inf
    x[1, cols * 4 // 5 :] = -np.inf
    y = ascend_ops.FP32SoftmaxAscend()(Tensor(x)).asnumpy()
    np.testing.assert_allclose(y, _softmax64(x), rtol=2e-5, atol=1e-9)


@in_child
def test_fp32_softmax_grad_on_npu(ascend_ops):
    import mindspore as ms
    from mindspore import Tensor, nn

    class Loss(nn.Cell):
        def __init__(self):
            super().__init__()
            self.softmax = ascend_ops.FP32SoftmaxAscend()

        def construct(self, x, w):
            return (self.softmax(x) * w).sum()

    rng = np.random.default_rng(1)
    x = rng.standard_normal((8, 33)).astype(np.float32)
    w = rng.standard_normal((8, 33)).astype(np.float32)
    grad = ms.jit(ms.grad(Loss(), grad_position=0))(Tensor(x), Tensor(w)).asnumpy()
    y = _softmax64(x)
    np.testing.assert_allclose(grad, y * (w - (w * y).sum(-1, keepdims=True)), rtol=1e-4, atol=1e-6)


@in_child
@pytest.mark.parametrize(
    "g, t, k, e, e_local, capacity",
    [(1, 37, 3, 8, 2, 15), (1, 4096, 6, 160, 20, 200), (3, 9, 2, 4, 4, 0), (4, 50, 2, 8, 2, 9)],
)
def test_expert_lookup_on_npu(ascend_ops, g, t, k, e, e_local, capacity):
    import mindspore as ms
    from mindspore import Tensor

    rng = np.random.default_rng(t)
    ids = rng.integers(-1, e + 1, (g, t, k)).astype(np.int32)  # includes out-of-range ids (range-checked on device)
    perm = rng.permutation(e)
    placement = np.zeros((e, 2), np.int32)
    placement[perm, 0] = np.arange(e) // e_local
    placement[perm, 1] = np.arange(e) % e_local
    cell = ascend_ops.ExpertLookupAscend(e, e_local)
    for run in (cell, ms.jit(cell.construct)):
        got = [o.asnumpy() for o in run(Tensor(ids), Tensor(placement), capacity)]
        for g, w in zip(got, _lookup_numpy(ids, placement, e_local, capacity)):
            np.testing.assert_array_equal(g, w)


@in_child
# PENALTY_IDS_STREAMED: more ids per row than one UB load, streamed for every tile (tests/helpers/npu_cases.py)
@pytest.mark.parametrize("b, v, length", [(1, 102400, 4096), (3, 97, 11), (2, 50, 200), *PENALTY_IDS_STREAMED])
def test_repetition_penalty_on_npu(ascend_ops, b, v, length):
    from mindspore import Tensor

    rng = np.random.default_rng(v)
    logits = (rng.standard_normal((b, v)) * 5).astype(np.float32)
    ids = rng.integers(0, v, (b, length)).astype(np.int32)
    got = ascend_ops.RepetitionPenaltyAscend()(Tensor(logits), Tensor(ids), 1.3).asnumpy()
    want = logits.copy()
    seen = np.zeros(logits.shape, bool)
    for row in range(b):
        for i in set(ids[row].tolist()):
            want[row, i] = logits[row, i] * np.float32(1.3) if logits[row, i] < 0 else logits[row, i] / np.float32(1.3)
            seen[row, i] = True
    np.testing.assert_array_equal(got[~seen], logits[~seen])  # copied bit for bit
    # The penalised ones are one multiply or divide on the AI Core scalar unit; no document found
    # says its float division rounds as IEEE 754 does, so allow one unit in the last place.
    np.testing.assert_array_max_ulp(got[seen], want[seen], maxulp=1)


@in_child
def test_public_cells_pick_the_ascend_kernels(ascend_ops):
    from ms_deepseek.ops import ExpertLookup, FP32Softmax, RepetitionPenalty

    assert ExpertLookup(8, 2).impl.kind == "ascend"
    assert FP32Softmax().impl.kind == "ascend"
    assert FP32Softmax(float32_input=True).impl.kind == "builtin"  # router, attention: MindSpore's Softmax
    assert RepetitionPenalty().impl.kind == "ascend"


@in_child
def test_float32_only_softmax_on_npu(ascend_ops):
    from mindspore import Tensor

    from ms_deepseek.ops import FP32Softmax

    x = np.random.default_rng(3).standard_normal((64, 160)).astype(np.float32) * 4  # router logits [N, E]
    y = FP32Softmax(float32_input=True)(Tensor(x)).asnumpy()
    np.testing.assert_allclose(y, _softmax64(x), rtol=2e-5, atol=1e-9)
