"""Fail fast when a worker dies: ``launch`` watches msrun and stops the whole job at once.

msrun's own process supervision (``process_entity/_api.py: join_processes``) polls its local workers every
second, logs ``Worker process <pid> exit with exception. Error code: <code>.`` and kills the other local workers;
it then waits for its scheduler process, which gives up only when its heartbeat timeout for the dead node
expires, and exits with a traceback that names no rank. Without it the survivors would wait in the collective
until ``HCCL_EXEC_TIMEOUT``.

:func:`run_supervised` builds on msrun's supervision instead of replacing it: it echoes msrun's output, records
which pid is which rank (msrun exports ``RANK_ID`` to each worker it starts: read from ``/proc/<pid>/environ``
while the workers live), and as soon as msrun reports a worker exit with an error it kills what is left of the
job (scheduler, workers, msrun) and prints one line naming the rank, how it ended and its log file.

Several nodes: each node's ``launch`` watches its own workers. A worker that dies on its own is recorded in the
shared run folder (``record_first_failure``); every node's launch reads that record while its job runs and stops
its own workers as soon as another node's rank is recorded, naming that rank, so no node waits for MindSpore's
scheduler to time out the lost node's heartbeat. A record older than the job (``job_start``) is a previous job's
in the same run folder and is ignored, and each node's launch clears only its own ranks' heartbeat files.

Hung ranks: the workers write their progress and median step time (jobs/preempt.py, ``Heartbeat``); the
:class:`Watchdog` stops a job that makes no progress, with every worker's stacks. When a collective gives up
first (a failed step), the failing worker waits (``Heartbeat.failed``) until this supervisor has dumped the
stacks of the ranks that had not started that step (``_answer_failed_steps``), which msrun would otherwise
SIGKILL the moment the failing worker exits.

Stop signals: SIGTERM, SIGHUP and SIGINT to ``launch`` (``timeout``, ``kill``, a closed ssh session, a
scheduler's stop) are forwarded to the workers as SIGTERM (they save a checkpoint at the next step and exit, see
jobs/preempt.py); when they are gone, after ``--stop-grace`` seconds or at a second signal, every process of
the job is SIGKILLed by session: msrun's own and each worker's (msrun starts every worker with ``os.setsid``), so
children a killed worker left to init go too. launch then exits with 128 + the signal number.

How fast each of these stops a job, measured: docs/measurements.md, "Stopping a job".
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from ms_deepseek.core.atomic import PARTIAL
from ms_deepseek.jobs.preempt import ACK_SUFFIX, FAILED_SUFFIX, SUPERVISOR_ENV
from ms_deepseek.jobs.processes import alive, descendants, exit_description, kill_job, stat_fields, worker_rank

# msrun's line (mindspore/parallel/cluster/process_entity/_api.py, join_processes)
_WORKER_FAILED = re.compile(r"Worker process (\d+) exit with exception\. Error code: (-?\d+)")
# the scheduler's line when a node's heartbeat stops (meta_server_node.cc, UpdateTopoState)
_NODE_TIMED_OUT = re.compile(r"The node: (\d+) is timed out")


def _timed_out_rank(log_dir: Path) -> Optional[int]:
    """The rank the scheduler (on node 0) saw stop answering, if it logged one."""
    try:
        text = (log_dir / "scheduler.log").read_text(errors="replace")
    except OSError:
        return None
    match = _NODE_TIMED_OUT.search(text)
    return int(match.group(1)) if match else None


# A worker that died because a peer did: its collective failed (CPU mccl ring: collective_ops_impl.cc,
# RunRingAllReduce; HCCL's notify-wait / execution timeouts) instead of failing on its own.
_PEER_FAILED = re.compile(
    r"Ring \w+ wait (?:receiving|sending)[^\n]* failed|HCCL_EXEC_TIMEOUT|EI0002|"
    r"Notify wait|hcclCommInitRootInfo|The node: \d+ is timed out"
)
FIRST_FAILURE = "first_failure"  # RUN_DIR/.heartbeat/first_failure: the first worker that died, any node


def _peer_failed(log: Path) -> bool:
    """True when the worker's log shows it failed waiting for another rank."""
    try:
        with open(log, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - 1_000_000))  # the end of the log: where the failure is
            return bool(_PEER_FAILED.search(fh.read().decode(errors="replace")))
    except OSError:
        return False


def record_first_failure(folder: Optional[Path], rank: int, how: str, log: Path) -> None:
    """Publish ``rank`` as the job's first dead worker in the run folder every node's launch sees (a shared
    file system); the first node to write wins (a hard link never replaces an existing file)."""
    if folder is None:
        return
    tmp = folder / f".{FIRST_FAILURE}.{os.getpid()}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp.write_text(
            json.dumps({"rank": rank, "how": how, "log": str(log), "time": time.time(), "host": socket.gethostname()})
        )
        os.link(tmp, folder / FIRST_FAILURE)
    except OSError:  # already written by another node (or no shared folder): nothing to add
        pass
    finally:
        try:
            tmp.unlink()
        except OSError:
            pass


def read_first_failure(folder: Optional[Path], wait_s: float = 0.0, since: float = 0.0) -> Optional[dict]:
    """The first dead worker another node's launch recorded, waiting up to ``wait_s`` for it; a record
    written before ``since`` (this job's start) is a previous job's and is not returned."""
    if folder is None:
        return None
    deadline = time.time() + wait_s
    while True:
        try:
            rec = json.loads((folder / FIRST_FAILURE).read_text())
            if isinstance(rec, dict) and isinstance(rec.get("rank"), int) and _recorded_at(rec) >= since:
                return rec
        except (OSError, ValueError):
            pass
        if time.time() >= deadline:
            return None
        time.sleep(0.2)


def _recorded_at(rec: dict) -> float:
    when = rec.get("time")
    return float(when) if isinstance(when, (int, float)) else 0.0


def clear_node_entries(folder: Path, ranks, job_start: float) -> None:
    """Before a node's job starts: remove this node's heartbeat files (its ranks' progress and failure
    markers) and a first-failure record older than ``job_start`` (a previous job's), and nothing else: on
    a shared run folder the other nodes' entries may belong to the job this node is joining."""
    for rank in ranks:
        # the heartbeat, its markers, and the temporary sibling of a write a killed worker left (core/atomic.py)
        for path in [folder / f"rank_{rank}{suffix}" for suffix in ("", FAILED_SUFFIX, ACK_SUFFIX)] + list(
            folder.glob(f".rank_{rank}{PARTIAL}*")
        ):
            try:
                path.unlink()
            except OSError:
                pass
    try:
        rec = json.loads((folder / FIRST_FAILURE).read_text())
        stale = not isinstance(rec, dict) or _recorded_at(rec) < job_start
    except (OSError, ValueError):
        stale = (folder / FIRST_FAILURE).exists()  # unreadable: not a record this job can use
    if stale:
        try:
            (folder / FIRST_FAILURE).unlink()
        except OSError:
            pass


STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


def _read_beats(folder: Path, step_s: Optional[Dict[int, float]] = None) -> Dict[int, Tuple[int, int]]:
    """rank -> (steps started, steps finished) from the workers' heartbeat files (jobs/preempt.py); the
    median step time each worker reports goes into ``step_s`` (rank -> seconds) when given."""
    out = {}
    try:
        entries = list(folder.iterdir())
    except OSError:
        return out
    for path in entries:
        if path.name.startswith("rank_") and path.name[5:].isdigit():
            try:
                fields = path.read_text().split()
                started, finished = int(fields[0]), int(fields[1])
                seconds = float(fields[2]) if len(fields) > 2 else None
            except (OSError, ValueError, IndexError):
                continue
            out[int(path.name[5:])] = (started, finished)
            if step_s is not None and seconds is not None and seconds > 0:
                step_s[int(path.name[5:])] = seconds
    return out


def _failed_steps(folder: Optional[Path], since: float = 0.0) -> Dict[int, int]:
    """rank -> the step that raised, from the rank_N.failed markers (jobs/preempt.py, Heartbeat.failed) written
    since ``since`` (another node's marker of a previous job is not this job's)."""
    out: Dict[int, int] = {}
    if folder is None:
        return out
    try:
        entries = list(folder.iterdir())
    except OSError:
        return out
    for path in entries:
        name = path.name
        if name.startswith("rank_") and name.endswith(FAILED_SUFFIX) and name[5 : -len(FAILED_SUFFIX)].isdigit():
            try:
                if path.stat().st_mtime >= since:
                    out[int(name[5 : -len(FAILED_SUFFIX)])] = int(path.read_text().split()[0])
            except (OSError, ValueError, IndexError):
                continue
    return out


_STACK_DUMP = "(most recent call first)"  # faulthandler's header of each thread's stack


def _dump_stacks(workers: Dict[int, int], log_dir: Path, wait_s: float = 15.0) -> List[int]:
    """SIGUSR1 to each worker (pid -> rank; faulthandler.register in every worker) and wait until its log
    holds the dump (or it died, or ``wait_s`` passed): the ranks whose stacks are in their logs."""
    offsets = {}
    for pid, rank in workers.items():
        try:
            offsets[pid] = (log_dir / f"worker_{rank}.log").stat().st_size
        except OSError:
            offsets[pid] = 0
        try:
            os.kill(pid, signal.SIGUSR1)
        except OSError:
            offsets.pop(pid)
    done, sizes, deadline = [], {}, time.time() + wait_s
    while offsets and time.time() < deadline:
        time.sleep(0.1)
        for pid in list(offsets):
            log = log_dir / f"worker_{workers[pid]}.log"
            try:
                size = log.stat().st_size
                with open(log, "rb") as fh:
                    fh.seek(offsets[pid])
                    dumped = _STACK_DUMP.encode() in fh.read()
            except OSError:
                size, dumped = -1, False
            # the dump is written from the signal handler in one go: done once the log stops growing
            if dumped and sizes.get(pid) == size:
                done.append(workers[pid])
                offsets.pop(pid)
            elif not alive(pid):
                offsets.pop(pid)
            sizes[pid] = size
    return sorted(done)


class Watchdog:
    """No step finished within ``factor`` x the median step time (at least ``min_s``), once a step after the
    first (the compile) has finished: the job is hung.

    The step time is the one the workers report in their heartbeats (the median of their recent steps,
    the compile left out: jobs/preempt.py), so it is known however many steps passed between two looks
    of a busy supervisor; heartbeats without it (an older worker) fall back to the supervisor's own
    measurement between looks that saw progress."""

    def __init__(self, folder: Optional[Path], factor: float, min_s: float):
        self.folder, self.factor, self.min_s = folder, factor, min_s
        self.top, self.since, self.per_step = None, time.time(), []  # per_step: s per step, each poll
        self.reported: Dict[int, float] = {}  # rank -> the median step time it reports

    def step_time(self) -> Optional[float]:
        if self.reported:
            return max(self.reported.values())  # the slowest rank sets the pace
        if self.per_step:
            ordered = sorted(self.per_step)
            return ordered[len(ordered) // 2]
        return None

    def limit(self) -> float:
        return max(self.factor * (self.step_time() or 0.0), self.min_s)

    def check(self) -> Optional[Tuple[float, Dict[int, Tuple[int, int]]]]:
        """(seconds without progress, heartbeats) when the job is hung, else None."""
        if self.folder is None or self.factor <= 0:
            return None
        reported: Dict[int, float] = {}
        beats, now = _read_beats(self.folder, reported), time.time()
        if not beats:
            return None
        self.reported.update(reported)
        top = max(f for _s, f in beats.values())
        if self.top is None or top > self.top:
            if self.top is not None and self.top >= 1:  # not the first step: it includes the compile
                self.per_step.append((now - self.since) / (top - self.top))
            self.top, self.since = top, now
            return None
        if self.step_time() is not None and now - self.since > self.limit():
            return now - self.since, beats
        return None


POLL_S = 0.2  # seconds between two looks of the supervisor at the job (processes, markers, heartbeats)


def run_supervised(
    cmd: List[str],
    env: Dict[str, str],
    log_dir: Path,
    stop_grace_s: float = 30.0,
    heartbeat_dir: Optional[Path] = None,
    watchdog_factor: float = 10.0,
    watchdog_min_s: float = 120.0,
    job_start: Optional[float] = None,
) -> Tuple[int, Optional[str]]:
    """Run msrun; return (exit code, one-line failure message or None).

    The message names the rank that died first, how it ended, and its msrun log file. SIGTERM, SIGHUP or
    SIGINT to this process are forwarded as SIGTERM to every worker (the trainer saves a checkpoint at the
    next step boundary and exits, see jobs/preempt.py); once the workers are gone, or ``stop_grace_s``
    after the signal, or at a second signal, every process of the job is killed and the exit code is
    128 + the signal's number.

    With a ``heartbeat_dir`` (the run folder's, shared by every node on a cluster): a worker whose step
    raised waits until the stacks of this node's ranks that did not reach that step are dumped into their
    logs (msrun kills them as soon as it sees the failed worker); and a first failure another node records
    there after ``job_start`` (default: now) stops this node's workers at once, naming that rank, instead
    of leaving them to wait in their next collective for a rank that is gone."""
    job = _SupervisedJob(
        log_dir,
        heartbeat_dir,
        time.time() if job_start is None else job_start,
        stop_grace_s,
        Watchdog(heartbeat_dir, watchdog_factor, watchdog_min_s),
    )
    job.start(cmd, env)
    code = job.supervise()
    return job.outcome(code)


class _SupervisedJob:
    """One msrun job under :func:`run_supervised`: what its output, the stop signals and each look at the
    job found, the loop that looks, and the one line that says how the job ended."""

    def __init__(
        self, log_dir: Path, heartbeat_dir: Optional[Path], job_start: float, stop_grace_s: float, watchdog: Watchdog
    ):
        self.log_dir, self.heartbeat_dir, self.job_start = log_dir, heartbeat_dir, job_start
        self.stop_grace_s, self.watchdog = stop_grace_s, watchdog
        self.failed: List[Tuple[int, int, float]] = []  # (pid, exit code, when msrun reported it)
        self.stops: List[Tuple[int, float]] = []  # (signal number, when) of the stop signals received
        self.previous = {}
        self.proc: Optional[subprocess.Popen] = None
        self.pumps: List[threading.Thread] = []
        self.ranks: Dict[int, int] = {}  # worker pid -> rank
        self.sessions = set()
        self.forwarded, self.workers_exited = False, False
        self.hung: Optional[Tuple[float, Dict[int, Tuple[int, int]]]] = None
        self.answered: Dict[int, int] = {}  # rank_N.failed markers handled: rank -> step
        self.dumped: List[
            int
        ] = []  # ranks whose stacks were dumped because a peer's step failed while they were behind
        self.peer_record: Optional[dict] = None  # another node's worker died first: this node's job was stopped for it

    # ---------------------------------------------------------------------------------------- running
    def start(self, cmd: List[str], env: Dict[str, str]) -> None:
        if threading.current_thread() is threading.main_thread():  # before msrun starts: no window without them
            for sig in STOP_SIGNALS:
                self.previous[sig] = signal.signal(sig, lambda signum, _frame: self.stops.append((signum, time.time())))
        env = dict(env, **{SUPERVISOR_ENV: str(os.getpid())})  # a failing worker waits for our stack dumps
        self.proc = subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
        )
        self.pumps = [
            threading.Thread(target=self._pump, args=(self.proc.stdout, sys.stdout), daemon=True),
            threading.Thread(target=self._pump, args=(self.proc.stderr, sys.stderr), daemon=True),
        ]
        for t in self.pumps:
            t.start()
        self.sessions = {self.proc.pid}

    def _pump(self, src, dst) -> None:
        for raw in iter(src.readline, b""):
            line = raw.decode(errors="replace")
            match = _WORKER_FAILED.search(line)
            if match and not self.failed:
                self.failed.append((int(match.group(1)), int(match.group(2)), time.time()))
            try:
                dst.write(line)
                dst.flush()
            except (OSError, ValueError):  # our own output closed: keep draining msrun's pipe
                pass
        src.close()

    def supervise(self) -> int:
        """Look at the job every :data:`POLL_S` until msrun exits or a look ends it; msrun's exit code."""
        try:
            while self.proc.poll() is None:
                if self._look():
                    break
                time.sleep(POLL_S)
            if self.failed and not self.stops:  # published before this node's job (and scheduler) goes
                self._record_own_failure()
            if (self.failed or self.stops or self.hung or self.peer_record) and self.proc.poll() is None:
                kill_job(self.sessions)  # the scheduler would otherwise wait out its heartbeat timeout
        except BaseException:  # our own death: never leave workers behind
            kill_job(self.sessions)
            raise
        finally:
            for sig, handler in self.previous.items():
                signal.signal(sig, handler)
            code = self.proc.wait()
            kill_job(self.sessions)  # whatever of the job outlived msrun (workers' children)
            for t in self.pumps:
                t.join(timeout=5)
        return code

    def _look(self) -> bool:
        """One look at the job: True when the loop ends (a stop signal done with, a dead worker, another
        node's first failure, a hung job)."""
        self._find_workers()
        if self.stops:
            return self._forward_stop()
        if self.failed:
            return True
        self.dumped += _answer_failed_steps(self.heartbeat_dir, self.ranks, self.log_dir, self.answered, self.job_start)
        record = read_first_failure(self.heartbeat_dir, since=self.job_start)
        if record is not None and self.ranks and record["rank"] not in self.ranks.values():
            self.peer_record = record
            return True
        self.hung = self.watchdog.check()
        if self.hung is not None:  # the ranks that beat have faulthandler on SIGUSR1 (else it would kill them)
            hung_ranks = self.hung[1]
            _dump_stacks({pid: r for pid, r in self.ranks.items() if r in hung_ranks and alive(pid)}, self.log_dir)
            return True
        return False

    def _find_workers(self) -> None:
        for pid in descendants(self.proc.pid):
            fields = stat_fields(pid)
            if fields and len(fields) > 3:
                self.sessions.add(int(fields[3]))
            if pid not in self.ranks:
                rank = worker_rank(pid)
                if rank is not None:
                    self.ranks[pid] = rank

    def _forward_stop(self) -> bool:
        if not self.forwarded:
            for pid in self.ranks:
                try:
                    os.kill(pid, signal.SIGTERM)
                except OSError:
                    pass
            self.forwarded = True
        self.workers_exited = not any(alive(pid) for pid in self.ranks)
        return len(self.stops) > 1 or self.workers_exited or time.time() - self.stops[0][1] > self.stop_grace_s

    def _first_failed(self) -> Tuple[int, int, float, Optional[int], Path, bool]:
        """(pid, exit code, when, rank, log, consequence) of the worker msrun reported first; ``consequence``:
        it died because a peer did, a SIGTERM we did not send (MindSpore stops the survivors when the
        scheduler loses a node) or a collective that failed waiting for another rank."""
        pid, worker_code, when = self.failed[0]
        rank = self.ranks.get(pid)
        log = self.log_dir / f"worker_{rank}.log" if rank is not None else self.log_dir
        consequence = worker_code == -signal.SIGTERM or (rank is not None and _peer_failed(log))
        return pid, worker_code, when, rank, log, consequence

    def _record_own_failure(self) -> None:
        """Our worker died on its own: the other nodes read it from the run folder."""
        _pid, worker_code, _when, rank, log, consequence = self._first_failed()
        if not consequence and rank is not None:
            record_first_failure(self.heartbeat_dir, rank, exit_description(worker_code), log)

    # ---------------------------------------------------------------------------------------- the outcome
    def outcome(self, code: int) -> Tuple[int, Optional[str]]:
        if self.stops:
            return self._stopped()
        if self.hung is not None:
            return 1, self._hung_message()
        if self.peer_record is not None and not self.failed:
            return 1, self._peer_message()
        if not self.failed:
            return code, None
        return 1, self._failure_message()

    def _stopped(self) -> Tuple[int, str]:
        signum, when = self.stops[0]
        name = signal.Signals(signum).name
        saved = "the workers had exited" if self.workers_exited or not self.ranks else "the workers were killed"
        how = (
            f"forwarded SIGTERM to the {len(self.ranks)} worker(s) (each saves a checkpoint at its next step "
            "boundary); "
            if self.ranks
            else ""
        )
        return 128 + signum, (
            f"received {name}: {how}every process of the job stopped "
            f"{time.time() - when:.1f} s after the signal (grace {self.stop_grace_s:g} s; {saved})"
        )

    def _hung_message(self) -> str:
        stalled, beats = self.hung
        reached = max(st for st, _f in beats.values())
        behind = sorted(r for r in set(self.ranks.values()) | set(beats) if beats.get(r, (-1, -1))[0] < reached)
        who = (
            f"rank{'s' if len(behind) > 1 else ''} {', '.join(map(str, behind))} did not reach step {reached}"
            if behind
            else f"every rank is inside step {reached}"
        )
        dog = self.watchdog
        return (
            f"watchdog: no step finished for {stalled:.0f} s (limit {dog.limit():.0f} s: "
            f"{dog.factor:g} x the median step time, at least {dog.min_s:g} s); {who}; "
            f"every worker's Python stacks are in {self.log_dir}/worker_N.log; stopped the job"
        )

    def _peer_message(self) -> str:
        peer, mine = self.peer_record, sorted(set(self.ranks.values()))
        return (
            f"worker rank {peer['rank']} (on {peer.get('host', 'another node')}) died first: "
            f"it {peer.get('how', 'failed')}; its log: {peer.get('log')}; this node's "
            f"worker rank{'s' if len(mine) > 1 else ''} {', '.join(map(str, mine))} would wait for it in "
            f"the next collective: stopped {'them' if len(mine) > 1 else 'it'} when that node's launch recorded it"
        )

    def _failure_message(self) -> str:
        pid, worker_code, when, rank, log, consequence = self._first_failed()
        first = read_first_failure(self.heartbeat_dir, wait_s=5.0, since=self.job_start) if consequence else None
        if first is not None and first["rank"] != rank:
            return (
                f"worker rank {first['rank']} (on {first.get('host', 'another node')}) died first: it "
                f"{first.get('how', 'failed')}; its log: {first.get('log')}; this node's worker rank {rank} "
                f"then {exit_description(worker_code)} and every other worker of this node was stopped"
            )
        lost = _timed_out_rank(self.log_dir)
        if lost is not None and lost not in self.ranks.values():
            # multi-node: a worker of another node died; MindSpore then stops the survivors here (SIGTERM,
            # when the scheduler's heartbeat for the lost node times out)
            return (
                f"worker rank {lost} (on another node) stopped answering the scheduler; its log is in that "
                f"node's msrun log folder (worker_{lost}.log); this node's worker rank {rank} "
                f"{exit_description(worker_code)} and every other worker of this node was stopped"
            )
        who = f"worker rank {rank} (pid {pid})" if rank is not None else f"worker pid {pid}"
        behind = self._behind_message(who, worker_code, rank, consequence)
        if behind is not None:
            return behind
        if consequence:
            return (
                f"a worker on another node died first (no node recorded which: the run folder is not shared "
                f"and this node has no scheduler log naming it; see node 0's launch output); this node's "
                f"{who} then {exit_description(worker_code)} waiting for it; its log: {log}"
            )
        return (
            f"{who} {exit_description(worker_code)}; its log: {log}; stopped every other worker of this node "
            f"{time.time() - when:.1f} s after msrun reported it"
        )

    def _behind_message(self, who: str, worker_code: int, rank: Optional[int], consequence: bool) -> Optional[str]:
        """The failed worker's collective gave up on a peer of this job that stopped making progress (hung):
        the message naming the ranks behind, else None."""
        folder = self.heartbeat_dir
        beats = _read_beats(folder) if consequence and folder is not None and rank is not None else {}
        reached = self.answered.get(rank, beats.get(rank, (-1, -1))[0])
        behind = sorted(r for r, (started, _done) in beats.items() if r != rank and started < reached)
        if not behind:
            return None
        ranks_ = ", ".join(map(str, behind))
        stacks = [r for r in behind if r in self.dumped]
        where = (
            f"Python stacks of rank{'s' if len(stacks) > 1 else ''} {', '.join(map(str, stacks))} in "
            f"{self.log_dir}/worker_N.log"
            if stacks
            else f"see {self.log_dir}/worker_N.log"
        )
        return (
            f"{who} {exit_description(worker_code)} in a collective waiting for rank{'s' if len(behind) > 1 else ''} "
            f"{ranks_}, which did not reach step {reached} (hung: {where}); stopped the job"
        )


def _answer_failed_steps(
    folder: Optional[Path], ranks: Dict[int, int], log_dir: Path, answered: Dict[int, int], since: float = 0.0
) -> List[int]:
    """A worker's step raised (rank_N.failed): dump the stacks of this node's live workers that had not
    started that step (a collective gave up waiting for them: they are the hung ones), then answer a
    worker of this node (rank_N.ack) so that it exits. Returns the ranks whose stacks were dumped. Only
    workers with a heartbeat are signalled: they registered faulthandler on SIGUSR1 before their first beat
    (SIGUSR1 would kill a worker that has not)."""
    dumped: List[int] = []
    for rank, step in _failed_steps(folder, since).items():
        if rank in answered:
            continue
        answered[rank] = step
        beats = _read_beats(folder)
        behind = {pid: r for pid, r in ranks.items() if r != rank and r in beats and beats[r][0] < step and alive(pid)}
        if behind:
            dumped += _dump_stacks(behind, log_dir)
        if rank in ranks.values():
            try:
                (folder / f"rank_{rank}{ACK_SUFFIX}").write_text("stacks dumped\n")
            except OSError:
                pass
    return dumped
