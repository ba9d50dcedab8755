"""Our AdamW (fused ``AdamWeightDecay`` kernel, bias correction folded into its scalars) against
MindFormers' ``AdamW`` as the reference: same parameters, gradients and schedule, several steps."""

import math

import numpy as np
import pytest
from mindspore import ops

from tolerances import assert_close_to_scale

SHAPES = {
    "model.layers.0.self_attn.o_proj.weight": (6, 5),  # decayed
    "model.layers.1.mlp.experts.up_proj.weight": (3, 4, 2),
    "model.layers.0.input_layernorm.weight": (5,),  # not decayed: norm
    "model.layers.1.mlp.gate.weight": (4, 5),  # not decayed: router
    "lm_head.bias": (7,),  # not decayed: bias
}
STEPS = 5


@pytest.fixture(autouse=True)
def _mindformers_oracle():
    """MindFormers is the oracle here, pinned on the MindSpore 2.9 line only (requirements-ms2.10.txt says why):
    on another line its absence skips these tests; on 2.9 it must be there."""
    from ms_deepseek.core.runtime import SUPPORTED_MINDSPORE_LINES, check_mindspore_version

    try:
        import mindformers  # noqa: F401
    except ImportError:
        if check_mindspore_version() == SUPPORTED_MINDSPORE_LINES[0]:
            raise
        pytest.skip("mindformers is not installed on this MindSpore line (requirements-ms2.10.txt)")


def _params(prefix, dtype, seed=0):
    import mindspore as ms

    rng = np.random.default_rng(seed)
    return [
        ms.Parameter(ms.Tensor(rng.normal(size=shape).astype(np.float32), dtype), name=prefix + name)
        for name, shape in SHAPES.items()
    ]


def _run(optimizer, grads):
    for g in grads:  # in GRAPH_MODE the Cell compiles to one graph on its first call
        optimizer(g)


def _compare(param_dtype, mode, **tol):
    import mindspore as ms
    from mindformers.core.optim.adamw import AdamW as MFAdamW

    from ms_deepseek.config.recipe import OptimSection
    from ms_deepseek.train import optim

    cfg = OptimSection(
        lr=2e-2, min_lr=1e-3, schedule="cosine", warmup_steps=2, weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8
    )
    total = 8
    ours_p = _params("", param_dtype)
    ours = optim.build_optimizer(ours_p, cfg, total)
    ref_p = _params("ref.", param_dtype)
    decay = [p for p in ref_p if not optim._no_decay(p.name[len("ref.") :])]
    no_decay = [p for p in ref_p if optim._no_decay(p.name[len("ref.") :])]
    assert len(decay) == 2 and len(no_decay) == 3
    ref = MFAdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}, {"order_params": ref_p}],
        learning_rate=optim.build_lr_schedule(cfg, total),
        betas=(0.9, 0.95),
        eps=1e-8,
        weight_decay=0.1,
    )
    ms.set_context(mode=mode)
    rng = np.random.default_rng(1)
    grads = [
        tuple(ms.Tensor(rng.normal(scale=0.5, size=SHAPES[n]).astype(np.float32), param_dtype) for n in SHAPES)
        for _ in range(STEPS)
    ]
    before = [p.asnumpy().astype(np.float32).copy() for p in ours_p]
    _run(ours, grads)
    _run(ref, grads)

    assert int(ours.global_step.asnumpy().reshape(-1)[0]) == STEPS
    state = optim.optimizer_state(ours)
    assert set(state) == {"global_step"} | {f"adam_{k}.{n}" for k in "mv" for n in SHAPES}
    for name, p, q, b in zip(SHAPES, ours_p, ref_p, before):
        got, want = p.asnumpy().astype(np.float32), q.asnumpy().astype(np.float32)
        assert np.abs(got - b).max() > 1e-3, name  # it did train
        assert_close_to_scale(got, want, **tol, err_msg=name)
        assert state[f"adam_m.{name}"].dtype == ms.float32
    for ours_s, ref_s in ((ours.exp_avg, ref.exp_avg), (ours.exp_avg_sq, ref.exp_avg_sq)):
        for a, b in zip(ours_s, ref_s):
            np.testing.assert_allclose(a.asnumpy(), b.asnumpy(), rtol=1e-6, atol=1e-7)


def test_fused_adamw_matches_mindformers_adamw_graph_fp32():
    import mindspore as ms

    _compare(ms.float32, ms.GRAPH_MODE, ulps=2, terms=STEPS)


def test_fused_adamw_matches_mindformers_adamw_pynative_fp32():
    import mindspore as ms

    _compare(ms.float32, ms.PYNATIVE_MODE, ulps=2, terms=STEPS)


def test_float16_parameters_take_the_float32_composite_update():
    import mindspore as ms

    # float16 storage: both round the same float32 result; allow one float16 ulp near |p| ~ 3
    _compare(ms.float16, ms.PYNATIVE_MODE, ulps=1, dtype=np.float16)


@pytest.mark.parametrize("warmup", [0, 3])
def test_cosine_schedule_matches_mindformers_without_its_branches(warmup):
    """The cosine Cell is MindFormers' CosineWithWarmUpLR written with selects (its tensor ``if``s split the
    compiled step into kernel graphs: train/schedules.py); MindFormers' own Cell is the oracle, step by step,
    in graph mode, warmup, decay and past the end. Planted: a schedule that forgets the end clamp differs."""
    import mindspore as ms
    from mindformers.core.lr.lr_schedule import CosineWithWarmUpLR

    from ms_deepseek.train.schedules import WarmupCosineLR

    total, lr, min_lr = 12, 2e-3, 1e-4
    ours = WarmupCosineLR(lr, warmup, total, min_lr)
    ref = CosineWithWarmUpLR(learning_rate=lr, warmup_steps=warmup, total_steps=total, lr_end=min_lr)
    ms.set_context(mode=ms.GRAPH_MODE)
    for step in range(0, total + 4):
        s = ms.Tensor(step, ms.int32)
        got, want = float(ours(s).asnumpy()), float(ref(s).asnumpy())
        assert got == pytest.approx(want, rel=1e-6, abs=1e-12), (warmup, step)

    class NoClamp(WarmupCosineLR):
        def construct(self, step):
            s = ops.cast(step, ms.float32).reshape(())
            percent = 0.5 * (1.0 + ops.cos(math.pi * (s - self.warmup) / self.cosine_steps))
            return self.min_lr + (self.lr - self.min_lr) * percent

    planted = NoClamp(lr, warmup, total, min_lr)
    s = ms.Tensor(total + 3, ms.int32)
    assert float(planted(s).asnumpy()) != pytest.approx(float(ref(s).asnumpy()), rel=1e-6)


def test_float16_composite_update_in_one_graph_matches_mindformers():
    import mindspore as ms

    # the compiled step: each parameter's update waits for the previous one's (optim.AdamW._composite)
    _compare(ms.float16, ms.GRAPH_MODE, ulps=1, dtype=np.float16)
