"""The comparison of ``plan --execute`` (ms_deepseek.verification.execute.compare) on hand-made values.

Two ranks hold the halves of one weight (device matrix [2], tensor map [0, -1]: rows split) and replicate an Adam
moment; one device's values are written out independently. Each check is shown to refuse the mistake it exists
for at the size that matters: an update of the wrong size, a NaN, a tensor the one device lacks, a tensor no rank
holds, a loss entry a thousand times smaller than the loss.
"""

import math

import numpy as np
import pytest

from ms_deepseek.verification.execute import compare as cmp

SPLIT = {"layout": [[2], [0, -1], [2, 4], 0, True, "", [4, 4]], "part": None}
ADAM = cmp.Adam(beta1=0.9, eps=1e-8)
LR = 1e-3


def _one_device(seed=0):
    """Step 0 and step 1 of one device: a [4, 4] weight moved by Adam's first step (sign of the gradient times lr),
    its first moment m = (1 - beta1) g, a counter."""
    rng = np.random.default_rng(seed)
    w0 = rng.normal(0, 0.02, (4, 4)).astype(np.float32)
    g = rng.normal(0, 1e-2, (4, 4)).astype(np.float32)
    before = {"w": w0, "adam_m.w": np.zeros_like(w0), "global_step": np.array([0], np.int32)}
    after = {
        "w": (w0 - LR * np.sign(g)).astype(np.float32),
        "adam_m.w": (0.1 * g).astype(np.float32),
        "global_step": np.array([1], np.int32),
    }
    return before, after


def _ranks(values, extra=None):
    """The two ranks' holdings of ``values``: rows 0-1 and 2-3 of ``w``, the rest replicated."""
    held = []
    for rank in range(2):
        now = {name: (v[2 * rank : 2 * rank + 2] if name == "w" else v).copy() for name, v in values.items()}
        now.update(extra or {})
        held.append(cmp.RankValues(rank, now, {}, {"w": SPLIT}))
    return held


def _step(mutate=None, extra=None):
    """Compare step 0 and step 1; ``mutate(rank, now)`` changes a rank's step-1 values."""
    before, after = _one_device()
    verdict = cmp.Comparison(stage_size=2, adam=ADAM)
    held = _ranks(before, extra)
    verdict.tensors(0, held, before)
    for rank, values in enumerate(_ranks(after, extra)):
        if mutate:
            mutate(rank, values.now)
        held[rank].before, held[rank].now = held[rank].now, values.now
    verdict.tensors(1, held, after, before)
    return verdict


def test_the_same_step_agrees_and_is_counted():
    verdict = _step()
    assert verdict.first_failure is None, verdict.first_failure
    assert verdict.compared == 12 and verdict.updates == 2 and verdict.reassembled == 3
    assert verdict.adam_allowance == 0 and verdict.rounding_allowance == 0


def test_an_update_of_half_the_size_on_one_shard_is_refused():
    def half(rank, now):
        if rank == 1:
            now["w"] = (now["w"] + 0.5 * LR * np.sign(now["adam_m.w"][2:4])).astype(np.float32)

    failure = _step(half).first_failure
    assert (failure.step, failure.rank, failure.name) == (1, 1, "update of w")
    assert failure.rel == pytest.approx(0.5, rel=1e-2)


def test_a_weight_that_does_not_move_is_refused_though_its_moments_are_right():
    def frozen(rank, now):
        if rank == 0:
            now["w"] = _one_device()[0]["w"][0:2].copy()

    failure = _step(frozen).first_failure
    assert (failure.step, failure.rank, failure.name) == (1, 0, "update of w") and failure.rel > 0.9


def test_a_nan_fails_and_names_where():
    def nan(rank, now):
        if rank == 1:
            now["w"][1, 2] = np.nan

    failure = _step(nan).first_failure
    assert (failure.step, failure.rank, failure.name) == (1, 1, "w") and failure.rel == math.inf
    assert "non-finite on the sharded side: 1 elements" in failure.detail
    assert cmp.rel(np.array([np.nan]), np.array([1.0])) == math.inf  # nan > tolerance is false: never let it pass


def test_a_tensor_the_one_device_lacks_is_refused_and_mindspores_buffers_are_counted():
    verdict = _step(extra={"accu_grads.w": np.zeros((2, 4), np.float32)})
    assert verdict.first_failure is None and verdict.buffers == {"accu_grads.*": 2}
    failure = _step(extra={"adam_s.w": np.zeros((4, 4), np.float32)}).first_failure
    assert (failure.step, failure.rank, failure.name) == (0, 0, "adam_s.w")
    assert "absent from the one-device run" in failure.detail


def test_a_nan_in_mindspores_buffer_fails():
    failure = _step(extra={"accu_grads.w": np.full((2, 4), np.nan, np.float32)}).first_failure
    assert failure is not None and failure.name == "accu_grads.w" and failure.rel == math.inf


def test_a_part_of_a_tensor_held_by_no_rank_is_refused():
    before, _ = _one_device()
    verdict = cmp.Comparison(stage_size=2, adam=ADAM)
    held = _ranks(before)[:1]  # rank 1's rows of w are missing
    verdict.tensors(0, held, before)
    failure = verdict.first_failure
    assert (failure.step, failure.rank, failure.name) == (0, -1, "w")
    assert failure.detail == "8 of its 16 elements are held by no rank"


def test_a_small_loss_entry_is_held_to_its_own_scale():
    verdict = cmp.Comparison(stage_size=1, adam=ADAM)
    want = np.array([6.0, 6.0, 1e-3, 0.0])
    verdict.scalars(1, 0, "loss vector", want * (1 + 2e-6), want, lambda i: f"entry {i}")
    assert verdict.first_failure is None
    off = want.copy()
    off[2] *= 1 + 1e-3  # 1e-7 of the loss, a thousandth of the balance loss
    verdict.scalars(1, 0, "loss vector", off, want, lambda i: f"entry {i}")
    assert verdict.first_failure.detail == "entry 2" and verdict.first_failure.rel == pytest.approx(1e-3)
    zero = want.copy()
    zero[3] = 1e-9  # an entry that is zero on one device must be zero
    verdict = cmp.Comparison(stage_size=1, adam=ADAM)
    verdict.scalars(1, 0, "loss vector", zero, want, lambda i: f"entry {i}")
    assert verdict.first_failure.detail == "entry 3"


def test_a_near_zero_gradient_is_held_to_one_adam_move_and_counted():
    """Adam moves an element whose gradient is at eps by an amount set by its last bits: a sign flip there is
    admitted and counted; a move of more than one Adam step is not."""
    before, after = _one_device()
    after["adam_m.w"][0, 0] = 0.1 * 1e-9  # a gradient of 1e-9, within 4 eps of zero

    def flip(size):
        def mutate(rank, now):
            if rank == 0:
                now["w"][0, 0] = before["w"][0, 0] + size * (after["w"][0, 0] - before["w"][0, 0])

        return mutate

    for size, admitted in ((-1.0, True), (5.0, False)):
        verdict = cmp.Comparison(stage_size=2, adam=ADAM)
        held = _ranks(before)
        verdict.tensors(0, held, before)
        for rank, values in enumerate(_ranks(after)):
            flip(size)(rank, values.now)
            held[rank].before, held[rank].now = held[rank].now, values.now
        verdict.tensors(1, held, after, before)
        assert (verdict.first_failure is None) == admitted, verdict.first_failure
        assert verdict.adam_allowance == 1
