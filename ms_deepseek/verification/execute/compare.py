"""The comparison of ``plan --execute`` (:mod:`.check`): the executed ranks against one device.

What is compared, per step, in this order (the verdict is the largest difference beyond its tolerance at the
earliest step that has one):

1. the step's outputs: the loss vector and gradient norm of every rank that computes them, the learning rate of
   every rank;
2. every tensor each rank holds against the slice of the one-device tensor that the rank's compiled layout names
   (:func:`.setup.slice_for_rank`):

   * before the first step, every value (a rank that read the wrong slice fails before any step);
   * after a step, a **trained weight's change** (the value after the step minus the value before, on the rank's
     slice) against the one-device change, relative to the largest one-device change of the whole tensor: a
     step size, bias correction or update that is wrong on one shard shows at the size of the update, not of
     the weight;
   * every other tensor's value (optimizer moments, counters, frozen weights), relative to the whole tensor's
     largest magnitude.

Tolerances come from each quantity's own scale (float32 throughout: two reduction orders differ in the last
bits). A weight stored in float32 holds its change only to its own spacing (``numpy.spacing``), so each element
of a change may differ by two spacings of the stored weight (one rounding on each side) beyond the relative
tolerance; the elements that needed it are counted. Adam divides a gradient element by its own root mean
square: an element whose one-device gradient is within :data:`ADAM_EPS_MULTIPLE` ``eps`` of zero moves by an
amount set by the last bits of that gradient, so those elements are held only to the size of one Adam move
(twice the tensor's largest one-device change); the ones that needed it are counted and printed.

A non-finite value fails wherever it appears, on either side. Coverage is counted: every tensor a rank holds has
a one-device counterpart unless it is one of MindSpore's own buffers (:data:`MINDSPORE_BUFFERS`, by name
pattern, with the reason), and every one-device tensor is reassembled from the ranks' slices; a tensor held by
no rank, or a part of one, fails, unless it is in no rank's compiled program at all (MindSpore leaves out what the
step never reads), is neither trained nor optimizer state, and stays unchanged on one device.
"""

from __future__ import annotations

import fnmatch
import math
import os
import sys
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import numpy as np

from ms_deepseek.verification.execute.setup import slice_for_rank

# relative to each entry of the loss vector, the gradient norm, the learning rate, starting values
LOSS_TOLERANCE = 1e-5
# The loss vector and gradient norm after the first step: the weights entering it differ by the elements the Adam
# allowance admitted (a near-zero gradient's sign decides a move of lr), so the routing statistics computed from
# them differ beyond rounding; the first step, from identical weights, keeps LOSS_TOLERANCE
LATER_LOSS_TOLERANCE = 1e-4
# relative to the whole tensor's largest magnitude: optimizer states, counters, frozen weights. A moment is a sum over
# at most a few hundred token rows here: float32 summation order moves it by about sqrt(n) eps of its scale (~2e-6)
VALUE_TOLERANCE = 1e-5
UPDATE_TOLERANCE = 1e-4  # relative to the whole tensor's largest one-device change: a trained weight's change
ROUNDING_SPACINGS = 2.0  # the stored weight's float32 spacing, once per side
# Adam's update m / (sqrt(v) + eps): for |g| within a few eps of zero the ratio is set by the last bits of g
ADAM_EPS_MULTIPLE = 4.0

# Tensors a rank holds that the one-device run has no counterpart for, or whose value is the layout's own
MINDSPORE_BUFFERS: Dict[str, str] = {
    "accu_grads.*": "MindSpore's gradient accumulation buffers (accumulation and pipeline passes; "
    "grad_accumulation_utils.cc), emptied at each step's end: held to finite values",
    "*.expert_placement": "the layout's expert -> (rank, slot) table (identity on one device): a wrong table "
    "shows in the loss and the experts' weights",
}


def buffer_pattern(name: str) -> Optional[str]:
    return next((p for p in MINDSPORE_BUFFERS if fnmatch.fnmatchcase(name, p)), None)


@dataclass
class Difference:
    step: int
    rank: int
    name: str
    rel: float
    detail: str = ""


@dataclass
class Adam:
    """What the comparison needs of the optimizer: beta1 (to recover a step's gradient from the first moments) and
    eps."""

    beta1: float
    eps: float


@dataclass
class Comparison:
    """The running verdict: the largest difference, the first beyond its tolerance, and the counts."""

    stage_size: int
    adam: Adam
    largest: Optional[Difference] = None
    failures: List[Difference] = field(default_factory=list)  # every difference beyond its tolerance, in order
    compared: int = 0  # tensor comparisons (a tensor of a rank at a step)
    updates: int = 0  # of them, trained weights' changes
    buffers: Dict[str, int] = field(default_factory=dict)  # pattern -> tensors held by the ranks
    reassembled: int = 0  # one-device tensors covered by the ranks' slices
    unused: Dict[str, np.ndarray] = field(default_factory=dict)  # one-device tensors in no rank's program: step 0
    adam_allowance: int = 0  # elements beyond the tight bound that only the Adam allowance admitted
    rounding_allowance: int = 0  # elements that needed the stored weight's spacing
    largest_update: Optional[Difference] = None

    # ------------------------------------------------------------------------------------- verdicts
    def note(self, diff: Difference, tolerance: float) -> None:
        if os.environ.get("MS_DEEPSEEK_EXECUTE_TRACE"):  # every comparison, for a developer's look
            print(
                f"step {diff.step} rank {diff.rank} {diff.name}: {diff.rel:.3e} (tolerance {tolerance:.1e})",
                file=sys.stderr,
            )
        if self.largest is None or _above(diff.rel, self.largest.rel):
            self.largest = diff
        if _above(diff.rel, tolerance):
            self.failures.append(diff)

    @property
    def first_failure(self) -> Optional[Difference]:
        """The verdict: of the earliest step with a difference beyond its tolerance, the largest (an infinite one,
        such as a NaN, the first found in the order of the module docstring): the place a mistake shows most,
        not the first tensor in name order that it reaches."""
        if not self.failures:
            return None
        step = min(d.step for d in self.failures)
        return max((d for d in self.failures if d.step == step), key=lambda d: d.rel)

    def scalars(self, step: int, rank: int, name: str, got, want, describe=None) -> None:
        """A step output (loss vector, gradient norm, learning rate), each entry within :data:`LOSS_TOLERANCE` of
        its own magnitude (the loss vector's entries range from the loss to balance-loss terms a thousand times
        smaller; an entry that is zero on one device must be zero). ``describe(i)`` names entry ``i``."""
        got, want = np.atleast_1d(np.asarray(got, np.float64)), np.atleast_1d(np.asarray(want, np.float64))
        bad = _non_finite(got, want)
        if bad or got.shape != want.shape:
            detail = bad or f"shape {list(got.shape)} against {list(want.shape)}"
            self.note(Difference(step, rank, name, math.inf, detail), LOSS_TOLERANCE)
            return
        each = np.abs(got - want) / np.maximum(np.abs(want), 1e-30)
        worst = int(np.argmax(each)) if each.size else 0
        detail = describe(worst) if describe and each.size > 1 else ""
        tolerance = LOSS_TOLERANCE if step <= 1 or name == "learning rate" else LATER_LOSS_TOLERANCE
        self.note(Difference(step, rank, name, float(each[worst]) if each.size else 0.0, detail), tolerance)

    # ------------------------------------------------------------------------------------- tensors
    def tensors(self, step: int, ranks: List["RankValues"], ref: Dict, before: Optional[Dict] = None) -> None:
        """Every tensor of every rank at ``step`` (0: the starting values; ``before``: the one-device values of the
        previous step, for the changes)."""
        covered: Dict[str, np.ndarray] = {}
        for held in ranks:
            for name in sorted(held.now):
                self._tensor(step, held, name, ref, before, covered)
        if step == 0:
            self._coverage(ref, covered)
        for name, start in self.unused.items():
            if not np.array_equal(ref[name], start, equal_nan=True):
                detail = "in no rank's compiled program, yet the one-device step changed it"
                self.note(Difference(step, -1, name, math.inf, detail), 0.0)

    def _tensor(self, step, held: "RankValues", name: str, ref: Dict, before, covered: Dict) -> None:
        got = held.now[name]
        pattern = buffer_pattern(name)
        if pattern is not None:
            self.buffers[pattern] = self.buffers.get(pattern, 0) + (step == 0)
            if not np.all(np.isfinite(got)):
                self.note(Difference(step, held.rank, name, math.inf, _non_finite(got, got)), 0.0)
            return
        if name not in ref:
            detail = "held by the rank, absent from the one-device run, and not one of MindSpore's buffers"
            self.note(Difference(step, held.rank, name, math.inf, detail), 0.0)
            return
        full, entry = ref[name], held.layout(name)
        want = slice_for_rank(full, entry, held.rank, self.stage_size)
        if step == 0:
            index = slice_for_rank(np.arange(full.size).reshape(full.shape), entry, held.rank, self.stage_size)
            mask = covered.setdefault(name, np.zeros(full.size, bool))
            mask[index.reshape(-1)] = True
        self.compared += 1
        text = layout_text(entry)
        if got.shape != want.shape:
            text += f"; shape {list(got.shape)} against {list(want.shape)}"
            self.note(Difference(step, held.rank, name, math.inf, text), 0.0)
            return
        bad = _non_finite(got, want)
        if bad:
            self.note(Difference(step, held.rank, name, math.inf, f"{bad}; {text}"), 0.0)
            return
        scale = _largest(full)
        if step == 0:
            self.note(Difference(step, held.rank, name, rel(got, want, scale), text), LOSS_TOLERANCE)
        elif f"adam_m.{name}" in ref:
            self._update(step, held, name, ref, before, text)
        else:
            self.note(Difference(step, held.rank, name, rel(got, want, scale), text), VALUE_TOLERANCE)

    def _update(self, step: int, held: "RankValues", name: str, ref: Dict, before: Dict, text: str) -> None:
        """A trained weight's change over ``step`` against the one-device change (module docstring)."""
        entry, rank = held.layout(name), held.rank

        def cut(values):
            return slice_for_rank(values, entry, rank, self.stage_size).astype(np.float64)

        one_change = ref[name].astype(np.float64) - before[name].astype(np.float64)
        scale = _largest(one_change)
        want = cut(ref[name]) - cut(before[name])
        got = held.now[name].astype(np.float64) - held.before[name].astype(np.float64)
        spacing = ROUNDING_SPACINGS * np.spacing(np.abs(held.now[name]).astype(np.float32)).astype(np.float64)
        # the step's one-device gradient, from the first moments: m_t = b1 m_{t-1} + (1 - b1) g_t
        b1 = self.adam.beta1
        gradient = (cut(ref[f"adam_m.{name}"]) - b1 * cut(before[f"adam_m.{name}"])) / (1.0 - b1)
        near_zero = np.abs(gradient) <= ADAM_EPS_MULTIPLE * self.adam.eps
        off = np.abs(got - want)
        tight = UPDATE_TOLERANCE * scale
        self.rounding_allowance += int(np.count_nonzero((off > tight) & (off <= tight + spacing) & ~near_zero))
        self.adam_allowance += int(np.count_nonzero(near_zero & (off > tight + spacing)))
        excess = np.where(near_zero, 0.0, np.maximum(off - spacing, 0.0))
        worst = float(np.max(excess)) / max(scale, 1e-30) if excess.size else 0.0
        adam_off = float(np.max(np.where(near_zero, off, 0.0))) if off.size else 0.0
        if adam_off > 2.0 * scale:  # beyond one Adam move even where the gradient is at eps
            worst = max(worst, adam_off / max(scale, 1e-30))
        if scale == 0.0 and float(np.max(off, initial=0.0)) > 0.0:
            worst = math.inf  # one device left the weight where it was; the rank moved it
        diff = Difference(step, rank, f"update of {name}", worst, f"{text}; largest one-device change {scale:.3g}")
        self.updates += 1
        if self.largest_update is None or _above(worst, self.largest_update.rel):
            self.largest_update = diff
        self.note(diff, UPDATE_TOLERANCE)

    def _coverage(self, ref: Dict, covered: Dict[str, np.ndarray]) -> None:
        """Every one-device tensor reassembled from the ranks' slices."""
        for name in sorted(ref):
            if buffer_pattern(name) is not None:
                continue
            mask = covered.get(name)
            trained = name.startswith(("adam_m.", "adam_v.")) or f"adam_m.{name}" in ref
            if mask is None and not trained:
                # MindSpore leaves a parameter that nothing in the step reads out of the compiled graph (a counter
                # of an unused feature, such as loss scaling in float32): it must then stay as it was on one device
                self.unused[name] = ref[name].copy()
            elif mask is None or not mask.all():
                missing = ref[name].size if mask is None else int(np.count_nonzero(~mask))
                detail = f"{missing} of its {ref[name].size} elements are held by no rank"
                self.note(Difference(0, -1, name, math.inf, detail), 0.0)
            else:
                self.reassembled += 1


@dataclass
class RankValues:
    """A rank's tensors by their names now and before the step, with their compiled layouts (``program.json``)."""

    rank: int
    now: Dict[str, np.ndarray]
    before: Dict[str, np.ndarray]
    layouts: Dict[str, Dict]

    def layout(self, name: str) -> Dict:
        return self.layouts.get(name, {"layout": [[], [], [], 0, True, "", []], "part": None})


# ------------------------------------------------------------------------------------------ helpers
def rel(a, b, scale: Optional[float] = None) -> float:
    """max |a - b| over the largest magnitude of ``b`` (or ``scale``: the whole tensor's, for a slice); infinite
    when the shapes differ or either side is not finite (``nan > tolerance`` is false: never let one through)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape or not (np.all(np.isfinite(a)) and np.all(np.isfinite(b))):
        return math.inf
    if a.size == 0:
        return 0.0
    if scale is None:
        scale = _largest(b)
    return float(np.max(np.abs(a - b))) / max(scale, 1e-30)


def _largest(x: np.ndarray) -> float:
    return float(np.max(np.abs(x))) if x.size else 0.0


def _above(value: float, bound: float) -> bool:
    return not (value <= bound)  # NaN is above every bound


def _non_finite(got: np.ndarray, want: np.ndarray) -> str:
    """Where the first non-finite value is, sharded side first; '' when both are finite."""
    for side, values in (("sharded", got), ("one device", want)):
        flat = np.asarray(values).reshape(-1)
        bad = np.flatnonzero(~np.isfinite(flat.astype(np.float64)))
        if bad.size:
            return (
                f"non-finite on the {side} side: {bad.size} elements, the first {flat[bad[0]]} at flat index {bad[0]}"
            )
    return ""


def layout_text(entry: Dict) -> str:
    """How the rank holds the tensor, as MindSpore compiled it: device matrix, tensor map, optimizer part."""
    dev, tmap = entry["layout"][0], entry["layout"][1]
    text = f"compiled layout: device matrix {list(dev)}, tensor map {list(tmap)}" if tmap else "replicated"
    if entry.get("part"):
        text += f", optimizer-shard part {entry['part'][0]} of {entry['part'][1]}"
    return text


def loss_part(index: int, experts: int) -> str:
    """What entry ``index`` of the step's output vector is (``train.step.StepOutputs``: total, loss, balance loss,
    then per MoE layer its expert loads, dropped fraction and three balance-loss terms)."""
    if index < 3:
        return ("total loss", "LM loss", "balance loss")[index]
    layer, part = divmod(index - 3, experts + 4)
    what = f"expert {part} load" if part < experts else ("dropped fraction", "l_exp", "l_dev", "l_com")[part - experts]
    return f"MoE layer {layer} (of the model's MoE layers): {what}; a routing difference"


def summary(c: Comparison) -> Tuple[str, ...]:
    """The counts, as the report prints them."""
    buffers = ", ".join(f"{n} {p}" for p, n in sorted(c.buffers.items())) or "none"
    return (
        f"{c.compared} tensor comparisons ({c.updates} of them trained weights' changes); {c.reassembled} one-device "
        f"tensors reassembled from the ranks' slices, {len(c.unused)} in no rank's program and unchanged on one "
        f"device ({', '.join(sorted(c.unused)) or 'none'}); MindSpore's buffers held by the ranks: {buffers}",
        f"elements of the trained weights' changes admitted by the Adam allowance (one-device gradient within "
        f"{ADAM_EPS_MULTIPLE:g} eps of zero): {c.adam_allowance}; by the rounding allowance (the stored weight's "
        f"spacing): {c.rounding_allowance}",
    )
