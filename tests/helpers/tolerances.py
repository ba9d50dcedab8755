"""Float comparisons whose allowance comes from the compared quantity's own scale.

Two float computations of the same value that order their roundings differently (another kernel, another
blocking of a reduction, another vector width on another CPU) differ by a few units in the last place of the
values they accumulate, not by a fixed absolute amount. :func:`assert_close_to_scale` allows

    ulps * terms * eps(dtype) * scale,     scale = max |expected| unless given,

for every element: ``ulps`` roundings per accumulated term, ``terms`` terms whose summation order may differ,
``eps`` the spacing of 1.0 in the coarser of the two dtypes (or ``dtype``, "bfloat16" by name). A failure message says how many
elements differ by more than one ulp of the scale (the tightest allowance) as well as how many exceed the
allowance, so a loose allowance shows up as "0 elements needed more than 1 ulp".
"""

from __future__ import annotations

import numpy as np


def _eps(actual: np.ndarray, expected: np.ndarray, dtype) -> float:
    if dtype == "bfloat16":  # numpy has no bfloat16: 8 significand bits
        return 2.0**-7
    if dtype is not None:
        return float(np.finfo(dtype).eps)
    floats = [a.dtype for a in (actual, expected) if np.issubdtype(a.dtype, np.floating)]
    if not floats:
        raise TypeError("assert_close_to_scale compares floats: neither side is a float array (compare exactly)")
    return max(float(np.finfo(d).eps) for d in floats)


def assert_close_to_scale(
    actual, expected, *, ulps: float = 4, terms: int = 1, dtype=None, scale: float | None = None, err_msg: str = ""
) -> float:
    """Assert |actual - expected| <= ulps * terms * eps * scale element by element; return the worst difference
    in ulps of the scale (eps * scale), for callers that also bound it from below.

    ``scale`` defaults to max |expected|; pass it when the result is smaller than what was summed to make it
    (cancellation: a sum of fractions that is 1, a difference of two large numbers).
    """
    actual = np.asarray(actual)
    expected = np.asarray(expected)
    if actual.shape != expected.shape:
        raise AssertionError(f"{err_msg} shapes differ: {actual.shape} against {expected.shape}".strip())
    eps = _eps(actual, expected, dtype)
    size = float(np.abs(expected).max()) if scale is None else float(scale)
    one_ulp = eps * size
    diff = np.abs(actual.astype(np.float64) - expected.astype(np.float64))
    if not np.all(np.isfinite(diff)):
        raise AssertionError(f"{err_msg} non-finite values or differences".strip())
    worst = float(diff.max()) if diff.size else 0.0
    worst_ulps = worst / one_ulp if one_ulp > 0 else (0.0 if worst == 0 else np.inf)
    allowance = ulps * terms * one_ulp
    if worst > allowance:
        over_one = int((diff > one_ulp).sum())
        over_all = int((diff > allowance).sum())
        at = np.unravel_index(int(diff.argmax()), diff.shape) if diff.ndim else ()
        message = (
            f"{over_all} of {diff.size} elements differ by more than {ulps} x {terms} ulps of the scale {size:.4g} "
            f"(allowance {allowance:.3g}, eps {eps:.3g}); worst {worst:.3g} = {worst_ulps:.1f} ulps at "
            f"{tuple(int(i) for i in at)} ({actual[at]!r} against {expected[at]!r}); "
            f"{over_one} elements needed more than 1 ulp"
        )
        raise AssertionError(f"{err_msg}: {message}" if err_msg else message)
    return worst_ulps
