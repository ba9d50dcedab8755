"""``ms-deepseek doctor``: preflight checks for a host (level 1), a node (8) or a cluster (16 / 64).

Each check prints one line: pass / warn / fail / skip, what was found and, when
something is wrong, the fix. Exit code 0 when nothing failed (warnings allowed),
1 when a check failed. ``--json`` prints the same as one JSON document.

Checks live in doctor/host.py (level 1) and doctor/node.py (8, 16); their ids are
listed by ``--list`` and cited by docs/troubleshooting.md as ``doctor:<id>``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import List, Optional, Tuple

from ms_deepseek.cli.args import host, non_negative_int, port, positive_float, positive_int
from ms_deepseek.core.errors import UserError
from ms_deepseek.doctor import host as host_checks  # noqa: F401  (importing it registers the checks)
from ms_deepseek.doctor import node as node_checks  # noqa: F401  (importing it registers the checks)
from ms_deepseek.doctor.core import (
    FAIL,
    LEVELS,
    PASS,
    REGISTRY,
    SKIP,
    WARN,
    Check,
    CheckResult,
    DoctorContext,
    checks_for_level,
    run_check,
)
from ms_deepseek.doctor.probe import SystemProbe

_TAG = {PASS: "PASS", WARN: "WARN", FAIL: "FAIL", SKIP: "SKIP"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--level",
        type=int,
        choices=LEVELS,
        default=1,
        help="1: this host and one device; 8: the whole node; 16 / 64: a cluster of 2 / 8 nodes "
        "(run the same command on every node)",
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--checkpoint-dir", default="runs", help="where checkpoints will be written (free disk check)")
    parser.add_argument("--need-gb", type=positive_float, default=None, help="checkpoint space the run needs, GiB")
    parser.add_argument("--requirements", default=None, help="pins file (default: the package's requirements.txt)")
    parser.add_argument("--master-addr", type=host, default=None, help="level 16/64: IP or host name of node 0")
    parser.add_argument("--master-port", type=port, default=8118, help="level 16/64: msrun scheduler port")
    parser.add_argument("--node-rank", type=non_negative_int, default=None, help="level 16/64: this node's rank")
    parser.add_argument("--no-smoke", action="store_true", help="skip the 10-step tiny training run")
    parser.add_argument(
        "--bench-mb", type=positive_float, default=64.0, help="all-reduce payload in MB (CPU: at most 8)"
    )
    parser.add_argument(
        "--bench-workers",
        type=positive_int,
        default=None,
        help="msrun workers per node for the bandwidth test (default: the NPUs, 2 on CPU)",
    )
    parser.add_argument(
        "--timeout", type=positive_float, default=600.0, help="seconds allowed for the smoke run / msrun job"
    )
    parser.add_argument("--only", default=None, help="comma-separated check ids to run (see --list)")
    parser.add_argument("--list", action="store_true", help="list the check ids and exit")


def context_from_args(args: argparse.Namespace, probe: Optional[SystemProbe] = None) -> DoctorContext:
    if args.node_rank is not None and args.node_rank < 0:
        raise UserError(f"--node-rank: must be >= 0, got {args.node_rank}")
    if args.bench_workers is not None and args.bench_workers < 1:
        raise UserError(f"--bench-workers: must be >= 1, got {args.bench_workers}")
    if args.bench_mb <= 0:
        raise UserError(f"--bench-mb: must be > 0, got {args.bench_mb}")
    if args.requirements:  # bad input, not a failed check: one line and exit 2 before any check runs
        from ms_deepseek.doctor.pins import read_pins

        read_pins(args.requirements)
    return DoctorContext(
        probe=probe or SystemProbe(),
        level=args.level,
        checkpoint_dir=args.checkpoint_dir,
        need_gb=args.need_gb,
        requirements=args.requirements,
        master_addr=args.master_addr,
        master_port=args.master_port,
        node_rank=args.node_rank,
        smoke=not args.no_smoke,
        bench_mb=args.bench_mb,
        bench_workers=args.bench_workers,
        timeout=args.timeout,
    )


def select_checks(level: int, only: Optional[str]) -> List[Check]:
    checks = checks_for_level(level)
    if only:
        wanted = [w.strip() for w in only.split(",") if w.strip()]
        unknown = [w for w in wanted if w not in REGISTRY]
        if unknown:
            raise UserError(f"--only: unknown check id(s) {', '.join(unknown)}; known: {', '.join(REGISTRY)}")
        checks = [c for c in checks if c.id in wanted]
    return checks


def format_line(chk: Check, result: CheckResult) -> str:
    line = f"[{_TAG[result.status]}] {chk.id:<20} {result.message}"
    if result.status in (WARN, FAIL) and result.fix:
        line += f" -> fix: {result.fix}"
    return line


def run_doctor(
    ctx: DoctorContext, checks: List[Check], echo=None, before=None
) -> List[Tuple[Check, CheckResult, float]]:
    """Run ``checks`` in order; ``before(check)`` is called as each starts, ``echo(line)`` as it finishes."""
    results = []
    for chk in checks:
        if before is not None:
            before(chk)
        start = time.perf_counter()
        result = run_check(chk, ctx)
        results.append((chk, result, time.perf_counter() - start))
        if echo is not None:
            echo(format_line(chk, result))
    return results


def exit_code(results) -> int:
    return 1 if any(r.status == FAIL for _, r, _ in results) else 0


def to_json(ctx: DoctorContext, results) -> dict:
    counts = {s: sum(1 for _, r, _ in results if r.status == s) for s in (PASS, WARN, FAIL, SKIP)}
    return {
        "level": ctx.level,
        "ok": counts[FAIL] == 0,
        "counts": counts,
        "checks": [
            {
                "id": c.id,
                "level": c.level,
                "title": c.title,
                "status": r.status,
                "message": r.message,
                "fix": r.fix,
                "seconds": round(sec, 3),
                "details": r.details,
            }
            for c, r, sec in results
        ],
    }


def run(args: argparse.Namespace) -> int:
    if args.list:
        for chk in checks_for_level(64):
            print(f"doctor:{chk.id:<20} level {chk.level:<3} {chk.title}")
        return 0
    ctx = context_from_args(args)
    checks = select_checks(args.level, args.only)
    if any(c.level >= 16 for c in checks) and not (args.master_addr or ctx.probe.env("MS_SCHED_HOST")):
        # a usage error, said before the node checks spend their time
        raise UserError(
            f"--level {args.level}: a cluster check needs node 0's address: pass --master-addr <node 0 "
            "IP> --node-rank <this node's rank> (the same command on every node), or export "
            "MS_SCHED_HOST"
        )
    if not args.json:
        print(f"ms-deepseek doctor --level {args.level}: {len(checks)} checks", flush=True)
    if args.json:
        results = run_doctor(ctx, checks)
    else:
        # progress on stderr (only on a terminal; the smoke run and msrun jobs take a while)
        from tqdm import tqdm

        from ms_deepseek.core.progress import progress_bar

        with progress_bar(total=len(checks), unit="check", leave=False) as bar:

            def before(chk):
                bar.set_description_str(chk.id)

            def echo(line):
                bar.update(1)
                tqdm.write(line, file=sys.stdout)

            results = run_doctor(ctx, checks, echo=echo, before=before)
    if args.json:
        print(json.dumps(to_json(ctx, results), indent=2, default=str))
    else:
        doc = to_json(ctx, results)["counts"]
        print(f"{doc[PASS]} passed, {doc[WARN]} warnings, {doc[FAIL]} failed, {doc[SKIP]} skipped")
    return exit_code(results)
