"""The processes of an msrun job on this node, read from /proc: which are workers (and of which rank), which
sessions they run in, and how to stop every one of them (jobs/supervise.py)."""

from __future__ import annotations

import os
import signal
import time
from typing import Dict, List, Optional


def children_map() -> Dict[int, List[int]]:
    """ppid -> child pids of every process visible in /proc."""
    out: Dict[int, List[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                stat = fh.read().decode(errors="replace")
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ')'
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 1:
            out.setdefault(int(fields[1]), []).append(int(entry))
    return out


def descendants(pid: int) -> List[int]:
    """Every process below ``pid`` (children first found, breadth first)."""
    children, out, todo = children_map(), [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def worker_rank(pid: int) -> Optional[int]:
    """RANK_ID of a worker msrun started (MS_ROLE=MS_WORKER), else None."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            env = dict(item.split(b"=", 1) for item in fh.read().split(b"\0") if b"=" in item)
    except OSError:
        return None
    if env.get(b"MS_ROLE") != b"MS_WORKER" or b"RANK_ID" not in env:
        return None
    try:
        return int(env[b"RANK_ID"])
    except ValueError:
        return None


def exit_description(code: int) -> str:
    """How a process ended, from its exit code: "exited with code 1", "was killed by SIGKILL"."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def stat_fields(pid: int) -> Optional[List[str]]:
    """/proc/<pid>/stat after the command name: [state, ppid, pgrp, session, ...]."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read().decode(errors="replace")
    except OSError:
        return None
    return stat[stat.rfind(")") + 2 :].split()


def session_members(sessions) -> List[int]:
    """Every live (not zombie) process whose session id is in ``sessions``."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = stat_fields(int(entry))
            if fields and len(fields) > 3 and fields[0] != "Z" and int(fields[3]) in sessions:
                out.append(int(entry))
    return out


def alive(pid: int) -> bool:
    fields = stat_fields(pid)
    return fields is not None and fields[0] != "Z"


def kill_job(sessions, timeout_s: float = 5.0) -> None:
    """SIGKILL every process of the job's sessions until none is left.

    The job is msrun's session (``launch`` starts msrun with ``start_new_session``, its scheduler stays in it)
    and one session per worker (msrun starts each with ``preexec_fn=os.setsid``: mindspore/parallel/cluster/
    process_entity/_api.py, _ComputeGraphNode.run). A worker's children keep its session id even when a
    SIGKILLed worker leaves them to init, which a walk of parent pids cannot find."""
    deadline = time.time() + timeout_s
    while True:
        members = session_members(sessions)
        if not members or time.time() > deadline:
            return
        for pid in members:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.05)
