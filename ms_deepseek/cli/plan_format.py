"""``ms-deepseek plan``'s output: the planner's verdict as text (:func:`format_result`) or one JSON object."""

from __future__ import annotations

import json
from typing import List, Optional

from ms_deepseek.parallel_plan.costs import MEMORY_CATEGORIES, QUANT_CATEGORIES


def emit(req, result, ranked: Optional[List]) -> None:
    """The verdict (and the other ranked layouts of a search) as text, or as one JSON object with ``req.json``."""
    if req.json:
        out = result.to_dict()
        if ranked is not None:
            out["ranked"] = [r.to_dict() for r in ranked]
        print(json.dumps(out, indent=2))
        return
    print(format_result(result))
    if ranked is not None and len(ranked) > 1:
        print("\nother layouts:")
        for r in ranked[1:]:
            verdict = "fits" if r.fits else "does not fit"
            lo, hi = r.tokens_per_s_range
            print(f"  {r.layout.describe():<58} {r.peak_gb:6.1f} GB  {lo:7.0f}-{hi:.0f} tokens/s/NPU  {verdict}")


def format_result(result) -> str:
    lines = [
        f"layout: {result.layout.describe()}  (world {result.layout.world_size}, "
        f"global batch {result.workload.global_batch_size} sequences, "
        f"grad accumulation {result.grad_accumulation})"
    ]
    if result.problems:
        lines.append("INVALID:")
        lines += [f"  {p}" for p in result.problems]
        return "\n".join(lines)
    verdict = "FITS" if result.fits else "DOES NOT FIT"
    lines.append(
        f"{verdict}: {result.peak_gb:.1f} GB per NPU (stage {result.worst.stage}) of {result.usable_gb:.1f} GB usable"
    )
    mem = result.memory_gb
    quant = result.workload.quant
    keys = [k for k in MEMORY_CATEGORIES if k not in QUANT_CATEGORIES]
    if quant is not None:
        group = (
            "one scale per output channel" if quant.group_size is None else f"one scale per {quant.group_size} inputs"
        )
        lines.append(
            f"quantized base: int{quant.bits}, {group} (weights below hold the quantized base; float32 "
            "scales and offsets, one weight dequantised to float32 at a time)"
        )
        keys = list(MEMORY_CATEGORIES)
    for key in keys:
        lines.append(f"  {key:<18}{mem[key]:9.2f} GB")
    if "eval_total" in mem:
        lines.append(
            f"  {'validation':<18}{mem['eval_total']:9.2f} GB at the eval graph's peak "
            f"(the training step: {mem['total']:.2f} GB)"
        )
    if result.eval_note:
        lines.append(f"  ({result.eval_note})")
    comm = result.comm_gb
    line = "traffic per NPU per step: " + ", ".join(f"{k} {v:.1f} GB" for k, v in comm.items())
    needed = sum(result.comm_minimum_gb.values())
    if needed > 0 and sum(comm.values()) > 1.0005 * needed:
        line += (
            f" ({sum(comm.values()) / needed:.3f} x the layout's minimum: a frozen embedding's gradient anchors "
            "MindSpore's accumulation pass)"
        )
    lines.append(line)
    t = result.time_s
    lo, hi = result.tokens_per_s_range
    sec = lambda x: f"{x:.1f}" if x >= 10 else f"{x:.3g}"  # noqa: E731
    lines.append(
        f"step {sec(t['step_high'])}-{sec(t['step'])} s (bubble {result.bubble_fraction:.1%}; at the low "
        f"end: pipeline {sec(t['pipeline'])} s, dp sync {sec(t['dp_sync'])} s)"
    )
    lines.append(
        f"throughput {lo:.0f}-{hi:.0f} tokens/s per NPU (MFU {result.mfu_range[0]:.1%}-"
        f"{result.mfu_range[1]:.1%}; low = MindFormers-calibrated efficiency, high = the DeepSeek "
        f"paper's, docs/planner.md)"
    )
    return "\n".join(lines)
