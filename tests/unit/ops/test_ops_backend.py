"""The backend switch, the kernel build cache, and the operators' input validation."""

import logging
import os
import shutil
import subprocess
import sys
import textwrap

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor
from mindspore.common import dtype as mstype

from ms_deepseek.core.errors import UserError
from ms_deepseek.ops import ExpertLookup, FP32Softmax, RepetitionPenalty, backend, build

from tolerances import assert_close_to_scale

ms.set_device("CPU")

PLACEMENT = Tensor(np.array([[0, 0], [0, 1], [1, 0], [1, 1]], np.int32))


def _all_kinds():
    return (
        ExpertLookup(4, 2).impl.kind,
        FP32Softmax().impl.kind,
        RepetitionPenalty().impl.kind,
    )


@pytest.fixture
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(backend, "_warned", set())


# --------------------------------------------------------------------------- choice


def test_cpu_kernels_by_default(monkeypatch):
    monkeypatch.delenv(backend.ENV_VAR, raising=False)
    assert _all_kinds() == ("cpu", "cpu", "cpu")


def test_env_var_forces_reference(monkeypatch):
    monkeypatch.setenv(backend.ENV_VAR, "reference")
    assert _all_kinds() == ("reference", "reference", "reference")
    monkeypatch.setenv(backend.ENV_VAR, "kernel")
    assert _all_kinds() == ("cpu", "cpu", "cpu")


def test_float32_only_softmax_is_mindspores_own_on_ascend(monkeypatch):
    """FP32Softmax(float32_input=True): the CPU kernel on CPU (more accurate than MindSpore's CPU
    Softmax), CANN's Softmax on Ascend (no custom operator needed), the reference when forced; the
    router and the attention take it."""
    from mindspore.ops import operations as P

    from ms_deepseek.config.model import DeepseekV2Config
    from ms_deepseek.model.mla import MLAttention
    from ms_deepseek.model.router import Router

    monkeypatch.delenv(backend.ENV_VAR, raising=False)
    assert FP32Softmax(float32_input=True).impl.kind == "cpu"
    monkeypatch.setattr(backend, "device_target", lambda: "Ascend")
    softmax = FP32Softmax(out_dtype=mstype.float16, float32_input=True)
    assert softmax.impl.kind == "builtin" and isinstance(softmax.impl.op, P.Softmax)
    x = np.random.default_rng(0).standard_normal((3, 5)).astype(np.float32)
    e = np.exp(x - x.max(-1, keepdims=True))
    y = softmax(Tensor(x))
    assert y.dtype == mstype.float16
    assert_close_to_scale(y.asnumpy(), e / e.sum(-1, keepdims=True), ulps=1)  # float32 softmax rounded to float16
    router = Router(
        DeepseekV2Config(
            hidden_size=8, n_routed_experts=4, num_experts_per_tok=2, topk_method="greedy", n_group=1, topk_group=1
        )
    )
    assert router.softmax.impl.kind == "builtin"  # the router's logits are float32
    attention = MLAttention(DeepseekV2Config(hidden_size=16, num_attention_heads=2, q_lora_rank=None))
    assert attention.softmax.impl.kind == "builtin"  # so are the attention scores (score_cast first)
    monkeypatch.setenv(backend.ENV_VAR, "reference")
    assert FP32Softmax(float32_input=True).impl.kind == "reference"


def test_ascend_cells_carry_their_docstrings():
    """A string after class attributes is not the docstring (FP32SoftmaxAscend had one there)."""
    import inspect

    from ms_deepseek.ops import ascend

    cells = [c for _, c in inspect.getmembers(ascend, inspect.isclass) if c.__module__ == ascend.__name__]
    assert {c.__name__ for c in cells} >= {"ExpertLookupAscend", "FP32SoftmaxAscend", "RepetitionPenaltyAscend"}
    for cls in cells:
        assert cls.__doc__ and cls.__doc__.strip(), cls.__name__
    assert ascend.FP32SoftmaxAscend.__doc__.startswith("Forward on the Ascend C kernel")


def test_bad_env_var_value_is_a_user_error(monkeypatch):
    monkeypatch.setenv(backend.ENV_VAR, "fast")
    with pytest.raises(UserError, match="MS_DEEPSEEK_OPS='fast'"):
        FP32Softmax()


def _broken_tree(tmp_path, op_name):
    root = tmp_path / "src"
    shutil.copytree(build.source_root(), root)
    with open(root / op_name / "cpu" / f"{op_name}_cpu.cc", "a") as f:
        f.write("\nthis is not C++;\n")
    return root


def test_failed_build_falls_back_with_one_warning(tmp_path, monkeypatch, caplog, fresh_warnings):
    monkeypatch.delenv(backend.ENV_VAR, raising=False)
    monkeypatch.setenv(build.CACHE_ENV, str(tmp_path / "cache"))
    broken = _broken_tree(tmp_path, "expert_lookup")
    monkeypatch.setattr(build, "source_root", lambda: broken)
    with caplog.at_level(logging.WARNING, logger="ms_deepseek.ops"):
        first = ExpertLookup(4, 2)
        second = ExpertLookup(4, 2)
        softmax = FP32Softmax()  # another operator builds fine from the same tree
    assert first.impl.kind == "reference" and second.impl.kind == "reference"
    assert softmax.impl.kind == "cpu"
    warnings = [r for r in caplog.records if r.name == "ms_deepseek.ops"]
    assert len(warnings) == 1
    message = warnings[0].getMessage()
    assert message.startswith("expert_lookup: cpu kernel unavailable") and "reference" in message
    assert "\n" not in message
    # The fallback computes the same thing.
    _, _, pos, keep = first(Tensor(np.array([[0, 1], [0, 1]], np.int32)), PLACEMENT, 1)
    np.testing.assert_array_equal(pos.asnumpy(), [[0, 0], [1, 1]])
    np.testing.assert_array_equal(keep.asnumpy(), [[1, 1], [0, 0]])
    assert not list((tmp_path / "cache").rglob("*.tmp"))  # no half-written library left behind


def test_missing_compiler_falls_back(tmp_path, monkeypatch, caplog, fresh_warnings):
    monkeypatch.delenv(backend.ENV_VAR, raising=False)
    monkeypatch.setenv(build.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setenv(build.CXX_ENV, str(tmp_path / "no-such-g++"))
    with caplog.at_level(logging.WARNING, logger="ms_deepseek.ops"):
        softmax = FP32Softmax()
    assert softmax.impl.kind == "reference"
    assert "not found" in caplog.records[-1].getMessage()


def test_unavailable_ascend_kernel_falls_back(monkeypatch, caplog, fresh_warnings):
    monkeypatch.delenv(backend.ENV_VAR, raising=False)
    monkeypatch.setattr(backend, "device_target", lambda: "Ascend")
    monkeypatch.delenv("ASCEND_CUSTOM_OPP_PATH", raising=False)
    monkeypatch.delenv("ASCEND_OPP_PATH", raising=False)
    with caplog.at_level(logging.WARNING, logger="ms_deepseek.ops"):
        kinds = _all_kinds()
    assert kinds == ("reference", "reference", "reference")
    messages = [r.getMessage() for r in caplog.records if r.name == "ms_deepseek.ops"]
    assert len(messages) == 3 and all("build_ascend.sh" in m for m in messages)


# --------------------------------------------------------------------------- build cache


def test_build_is_cached_and_keyed_by_source(tmp_path, monkeypatch):
    monkeypatch.setenv(build.CACHE_ENV, str(tmp_path / "cache"))
    lib = build.build("repetition_penalty")
    assert lib.is_file() and lib.parent.parent == tmp_path / "cache"
    mtime = lib.stat().st_mtime_ns
    assert build.build("repetition_penalty") == lib and lib.stat().st_mtime_ns == mtime
    changed = tmp_path / "src"
    shutil.copytree(build.source_root(), changed)
    with open(changed / "repetition_penalty" / "common" / "repetition_penalty_tiling_logic.h", "a") as f:
        f.write("\n// changed\n")
    assert build.library_path("repetition_penalty", changed) != lib
    with open(changed / "common" / "msds_kernel_common.h", "a") as f:
        f.write("\n// shared header changed too\n")
    assert build.library_path("expert_lookup", changed) != build.library_path("expert_lookup")


def test_concurrent_builds_share_one_library(tmp_path):
    """Two processes building into an empty cache at once both get a complete library."""
    script = textwrap.dedent(
        f"""
        import importlib.util, sys
        spec = importlib.util.spec_from_file_location("msds_build", {str(build.__file__)!r})
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        print(mod.build("fp32_softmax"))
        """
    )
    env = dict(os.environ, **{build.CACHE_ENV: str(tmp_path / "cache")})
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs
    paths = {out.strip() for out, _ in outputs}
    assert len(paths) == 1
    files = [p for p in (tmp_path / "cache").rglob("*") if p.is_file()]
    assert [p.name for p in files] == ["libfp32_softmax_cpu.so"]


def test_sources_ship_with_the_package():
    root = build.source_root()
    assert root.parent.name == "ms_deepseek"
    for op in backend.OPS:
        sources = build.kernel_sources(op)
        assert sources[0].name == f"{op}_cpu.cc"
        assert any(p.name == f"{op}_tiling_logic.h" for p in sources)
        for part in ("op_host", "op_kernel"):
            assert list((root / op / part).glob("*.cpp")), f"{op}/{part} has no sources"
    assert (root / "build_ascend.sh").is_file()


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "args, match",
    [
        ((0, 1), "num_experts must be a positive int"),
        ((8, 3), "experts_per_rank=3 does not divide num_experts=8"),
        ((True, 1), "num_experts must be a positive int"),
        ((8, 2.0), "experts_per_rank must be a positive int"),
    ],
)
def test_expert_lookup_bad_construction(args, match):
    with pytest.raises(UserError, match=match):
        ExpertLookup(*args)


@pytest.mark.parametrize("capacity", [-1, 1.5, None, True])
def test_expert_lookup_bad_capacity(capacity):
    with pytest.raises(UserError, match="capacity must be an int >= 0"):
        ExpertLookup(4, 2)(Tensor(np.zeros((2, 1), np.int32)), PLACEMENT, capacity)


def test_expert_lookup_bad_shapes():
    with pytest.raises(UserError, match=r"placement must have shape \(4, 2\)"):
        ExpertLookup(4, 2)(Tensor(np.zeros((2, 1), np.int32)), Tensor(np.zeros((3, 2), np.int32)), 1)
    with pytest.raises(UserError, match="topk_ids must be"):
        ExpertLookup(4, 2)(Tensor(np.zeros((2,), np.int32)), PLACEMENT, 1)


def test_softmax_bad_out_dtype():
    with pytest.raises(UserError, match="out_dtype must be float32, float16 or bfloat16"):
        FP32Softmax(out_dtype=mstype.int32)


LOGITS = Tensor(np.zeros((2, 5), np.float32))


@pytest.mark.parametrize("penalty", [0, -1.0, float("nan"), True, "2"])
def test_repetition_penalty_bad_value(penalty):
    with pytest.raises(UserError, match="repetition penalty must be"):
        RepetitionPenalty()(LOGITS, Tensor(np.zeros((2, 1), np.int32)), penalty)


@pytest.mark.parametrize(
    "logits, ids, match",
    [
        (LOGITS, np.array([[0], [5]], np.int32), r"token id 5 at \[1, 0\] is outside the vocabulary \[0, 5\)"),
        (LOGITS, np.array([[-1], [0]], np.int32), r"token id -1 at \[0, 0\]"),
        (LOGITS, np.zeros((3, 1), np.int32), r"token_ids must be \[batch=2, length\]"),
        (Tensor(np.zeros((2, 5, 1), np.float32)), np.zeros((2, 1), np.int32), r"logits must be \[batch, vocab\]"),
        (Tensor(np.zeros((2, 5), np.float16)), np.zeros((2, 1), np.int32), "logits must be float32"),
        (LOGITS, np.zeros((2, 1), np.float32), "token_ids must be int32"),
    ],
)
def test_repetition_penalty_bad_inputs(logits, ids, match):
    with pytest.raises(UserError, match=match) as err:
        RepetitionPenalty()(logits, Tensor(ids), 1.2)
    assert "\n" not in str(err.value)


def test_backend_rejects_unknown_operator():
    with pytest.raises(ValueError, match="unknown operator"):
        backend.choose("flash_attention")
