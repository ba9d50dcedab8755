#!/usr/bin/env python3
"""The communication MindSpore inserted in a recipe's compiled training step, beside the planner's traffic model.

    python tools/compile_vs_planner.py COMPILE.json [COMPILE.json ...]

Each COMPILE.json is the output of ``ms-deepseek plan --recipe R --compile --json`` (a reduced depth and
micro-batch count). For the same reduced model (the same ``--set``s) the planner's per-step traffic per NPU
(``plan --recipe R --json``: ``communication_gb_per_step``) is computed here, and a markdown table printed:

* expert parallel: MindSpore's AlltoAll input bytes per step (the buffers this rank sends; forward,
  recomputed forward and backward exchanges) against the planner's ``ep_alltoall``;
* data parallel / optimizer sharding: AllGather + ReduceScatter + AllReduce + the micro-step gathers
  (parameters gathered for the forward, gradients reduced) against the planner's ``dp_sync`` plus its
  ``tp_allreduce``.

MindSpore's figures are the bytes this rank sends on a ring for each communication operator in the IR after
its ``validate`` pass (this rank's slice shapes; AllGather (n-1) x its input, ReduceScatter and AlltoAll
(n-1)/n, AllReduce 2(n-1)/n, n the operator's group size), the way the planner counts. The ratio is
planner / MindSpore.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from ms_deepseek.diagnostics.compile_check import stage_layers_setting

EP_KINDS = ("AlltoAll", "AlltoAllV")
DP_KINDS = (
    "AllGather",
    "ReduceScatter",
    "AllReduce",
    "_MicroStepAllGather",
    "_MirrorOperator",
    "_MirrorMicroStepOperator",
)


def planner(recipe: str, layers: int, stage_layers, micro: int, kind: str) -> dict:
    """The planner's traffic for the reduced model the compile ran (its depth, cut and micro-batches)."""
    key = "parallel.micro_batches" if kind == "micro_batches" else "train.grad_accum_steps"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "ms_deepseek.cli",
            "plan",
            "--recipe",
            recipe,
            "--json",
            "--set",
            f"model.overrides.num_hidden_layers={layers}",
            "--set",
            stage_layers_setting(stage_layers or None),
            "--set",
            f"{key}={micro}",
        ],
        capture_output=True,
        text=True,
    )
    if not out.stdout.strip():
        raise SystemExit(f"plan failed for {recipe}: {out.stderr.strip()[-300:]}")
    return json.loads(out.stdout)["communication_gb_per_step"]


def row(report: dict) -> str:
    name = Path(report["recipe"]).stem
    ok = [r for r in report["ranks"] if r["graphs"].get("train", {}).get("ok")]
    if not ok:
        return f"| `{name}` | {report['layout']} | not compiled | | | | |"
    comm = ok[0]["graphs"]["train"].get("communication", {})
    ep_ms = sum(comm.get(k, {}).get("wire_mb", 0.0) for k in EP_KINDS) / 1024  # GiB sent on a ring
    dp_ms = sum(comm.get(k, {}).get("wire_mb", 0.0) for k in DP_KINDS) / 1024
    plan = planner(
        report["recipe"],
        report["layers"],
        report.get("stage_layers"),
        report["micro_batches"],
        report["micro_batches_kind"],
    )
    ep_pl = plan["ep_alltoall"] * 1e9 / 2**30
    dp_pl = (plan["dp_sync"] + plan["tp_allreduce"]) * 1e9 / 2**30
    ratio = lambda a, b: f"{a / b:.2f}" if b else "—"
    counts = ", ".join(f"{k} {v['count']}" for k, v in sorted(comm.items()))
    return (
        f"| `{name}` | {report['layout']}, {report['layers']} layers, {report['micro_batches']} micro | {counts} | "
        f"{ep_ms:.2f} / {ep_pl:.2f} ({ratio(ep_pl, ep_ms)}) | {dp_ms:.2f} / {dp_pl:.2f} ({ratio(dp_pl, dp_ms)}) |"
    )


def main(argv) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    print(
        "| recipe | compiled | MindSpore's communication operators per step (rank of the last stage) | "
        "expert all-to-all GiB: MindSpore / planner (ratio) | dp + tp GiB: MindSpore / planner (ratio) |"
    )
    print("|---|---|---|---|---|")
    for path in argv:
        try:
            report = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            print(f"{path}: not a plan --compile --json output ({exc})", file=sys.stderr)
            return 2
        print(row(report))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
