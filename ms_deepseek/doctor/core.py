"""Check registry, results and run context for ``ms-deepseek doctor``.

A check is a function ``(ctx) -> CheckResult`` registered under a stable id with
the lowest doctor level that runs it (1: one host and device, 8: one node,
16: several nodes). Ids are what docs/troubleshooting.md cites as
``doctor:<id>``; never rename one without updating the guide (a test checks it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

from ms_deepseek.doctor.probe import SystemProbe

PASS, WARN, FAIL, SKIP = "pass", "warn", "fail", "skip"
STATUSES = (PASS, WARN, FAIL, SKIP)
LEVELS = (1, 8, 16, 64)
DEVICES_PER_NODE = 8  # Atlas 800T A2

# Reference figures, the planner's defaults (parallel_plan/costs.py Hardware; docs/planner.md, "Anchors"):
# HCCS inside a node, RoCE across nodes.
HCCS_GBPS_PER_PEER = 56.0
ROCE_GBPS_PER_NPU = 25.0


@dataclass
class CheckResult:
    """Verdict of one check: ``message`` says what was found, ``fix`` what to do (warn / fail)."""

    status: str
    message: str
    fix: str = ""
    details: Dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {self.status!r}")


def passed(message: str, **details) -> CheckResult:
    return CheckResult(PASS, message, details=details)


def warned(message: str, fix: str, **details) -> CheckResult:
    return CheckResult(WARN, message, fix, details)


def failed(message: str, fix: str, **details) -> CheckResult:
    return CheckResult(FAIL, message, fix, details)


def skipped(message: str, **details) -> CheckResult:
    return CheckResult(SKIP, message, details=details)


NO_NPU = "skipped: no NPU"


@dataclass
class Check:
    id: str
    level: int
    title: str
    func: Callable[["DoctorContext"], CheckResult]
    heavy: bool = False  # runs a training step or an msrun job: after every cheap check


REGISTRY: Dict[str, Check] = {}


def check(check_id: str, level: int, title: str, heavy: bool = False):
    """Register ``func`` as check ``check_id`` run from doctor level ``level`` upwards."""
    if level not in (1, 8, 16):
        raise ValueError(f"check level must be 1, 8 or 16, got {level}")

    def wrap(func):
        if check_id in REGISTRY:
            raise ValueError(f"duplicate doctor check id {check_id!r}")
        REGISTRY[check_id] = Check(check_id, level, title, func, heavy)
        return func

    return wrap


@dataclass
class DoctorContext:
    """Everything a check may look at; tests build one with a RecordedProbe."""

    probe: SystemProbe = field(default_factory=SystemProbe)
    level: int = 1
    checkpoint_dir: str = "runs"
    need_gb: Optional[float] = None
    requirements: Optional[str] = None  # path override for the pins file
    master_addr: Optional[str] = None
    master_port: int = 8118
    node_rank: Optional[int] = None
    smoke: bool = True
    smoke_steps: int = 10
    bench_mb: float = 64.0
    bench_workers: Optional[int] = None  # msrun workers on this node (default: devices, or 2 on CPU)
    timeout: float = 600.0
    cache: Dict[str, Any] = field(default_factory=dict)

    @property
    def nodes(self) -> int:
        return max(1, self.level // DEVICES_PER_NODE)

    def memo(self, key: str, compute: Callable[[], Any]) -> Any:
        """Compute ``key`` once per doctor run (npu-smi output, the msrun job, ...)."""
        if key not in self.cache:
            self.cache[key] = compute()
        return self.cache[key]

    def replace(self, **changes) -> "DoctorContext":
        return dataclasses.replace(self, cache={}, **changes)


def checks_for_level(level: int) -> List[Check]:
    """Registered checks run at ``level``: cheap ones first (by level, then registration order),
    then the heavy ones (smoke run, msrun jobs)."""
    chosen = [c for c in REGISTRY.values() if c.level <= level]
    order = {c.id: i for i, c in enumerate(REGISTRY.values())}
    return sorted(chosen, key=lambda c: (c.heavy, c.level, order[c.id]))


def run_check(chk: Check, ctx: DoctorContext) -> CheckResult:
    """Run one check; a crash inside a check is reported as its failure, not a traceback."""
    from ms_deepseek.core.errors import UserError

    try:
        result = chk.func(ctx)
    except UserError as exc:  # bad input the check depends on (e.g. no requirements file)
        return failed(str(exc), "fix the file or option named in the message")
    except Exception as exc:  # noqa: BLE001 - a broken check must not hide the others
        return failed(
            f"the check itself crashed: {type(exc).__name__}: {exc}",
            "report this as a bug in ms-deepseek doctor (run with --json for details)",
        )
    if not isinstance(result, CheckResult):
        return failed(f"the check returned {result!r}", "report this as a bug in ms-deepseek doctor")
    return result
