"""The test suite's two tiers, and the guard that keeps compiles and multi-process jobs out of the default one.

* **default** (``bash tools/test.sh``): lint, format, unit, CLI and repository tests, and the tests marked ``smoke``
  (one small ``plan --compile``, one small ``plan --execute``).
* **full** (``bash tools/test.sh --full``, what CI runs): the default tier and every test marked ``slow``: each
  recipe's compile and execution, the planted mistakes, msrun jobs, the docs' commands.

A test belongs to the full tier when it is marked ``slow``: every test under ``tests/compile``, ``tests/lines`` and
``tests/msrun`` and every test marked ``msrun`` is (:func:`tier_marker`). :func:`launches_heavy_work` names what a
test may start only when it is marked ``slow``, ``heavy`` or ``smoke``: a compile worker or the one-device run of
``plan --compile`` / ``--execute``, a dry-run compile, msrun, or the CLI asked for ``plan --compile`` /
``--execute`` in a process of its own; the conftest records every process a test starts and fails a test that
started one without such a mark.

``bash tools/test.sh`` runs the default tier on two pytest-xdist processes; ``--full`` then runs the slow tests in
two processes side by side, each one test at a time: ``tests/compile`` (every compile or execution keeps the cores
busy with its own compile workers and holds several GB of host memory, so two of them at once would gain little
and risk much) and the rest (trainings and msrun jobs, which bind ports, time their workers' heartbeats and wait on
them much of the time). A test that compiles a recipe's layout belongs under ``tests/compile``.
"""

from __future__ import annotations

import os
from typing import Optional, Sequence

# folders whose every test is in the full tier
FULL_TIER_FOLDERS = ("compile", "lines", "msrun")
# set: the conftest lists every collected test with its tier marks (tests/repo/test_tiers.py reads it)
LIST_ENV = "MS_DEEPSEEK_LIST_TIERS"
# the marks that let a test start a compile or an msrun job
MAY_COMPILE = ("slow", "heavy", "smoke")
# the process modules of plan --compile / --execute (verification/compile/check.py and verification/execute/check.py start them)
_WORKER_MODULES = ("ms_deepseek.verification.compile.worker", "ms_deepseek.verification.execute.one_device")


def tier_marker(relative_path: str, marks: Sequence[str] = ()) -> Optional[str]:
    """``slow`` for a test file under one of :data:`FULL_TIER_FOLDERS` (``relative_path`` from ``tests/``) or a test
    marked ``msrun``, unless it is marked ``smoke``."""
    if "smoke" in marks:
        return None
    parts = relative_path.replace(os.sep, "/").split("/")
    return "slow" if (parts and parts[0] in FULL_TIER_FOLDERS) or "msrun" in marks else None


def launches_heavy_work(argv: Sequence[str], env: Optional[dict] = None) -> Optional[str]:
    """What a started process is, when it is a compile or an msrun job; None for anything else."""
    # a shell command line (``bash -c "..."``) counts by its words
    args = [word for a in (argv if isinstance(argv, (list, tuple)) else [argv]) for word in str(a).split()]
    if "--help" in args or "-h" in args:  # a command's help starts nothing
        return None
    for module in _WORKER_MODULES:
        if module in args:
            return f"a MindSpore compile ({module})"
    if any(os.path.basename(a) == "msrun" for a in args) or "mindspore.parallel.cluster.run" in args:
        return "an msrun job"
    if env and env.get("MS_SIMULATION_LEVEL") is not None:
        return "a MindSpore dry-run compile (MS_SIMULATION_LEVEL)"
    cli = any(a in ("ms_deepseek.cli", "ms-deepseek") or a.endswith("/ms-deepseek") for a in args)
    if cli and "plan" in args and ("--compile" in args or "--execute" in args):
        return "plan --compile / --execute"
    return None
