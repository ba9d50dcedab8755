"""One writer per run folder: ``RUN_DIR/.lease``, held by the job that trains into it and renewed while it lives.

A ``train`` whose run folder is held by another live job is refused in one line naming the holder (host,
pid, since when, last heartbeat), before it reads or writes anything there: two jobs in one folder remove
each other's partial checkpoints and interleave checkpoints and metrics. The lease is a small JSON file
(not a ``flock``, which does not reach across the nodes that share a folder); only the job's rank 0 holds
it, the other ranks of the same job are not asked.

* taken by linking a complete temporary file to the name (``link`` fails on an existing name, atomically on
  local file systems and NFS), so the lease is never seen half-written;
* renewed every :data:`RENEW_S` seconds by a thread of the holder (the heartbeat), which stops renewing
  and marks the lease lost when the file names another holder (taken over), so that the old job stops
  before its next step or save instead of writing beside the new one;
* taken over without a word when its holder is gone for sure (same host, its pid no longer runs), with
  a line when its heartbeat is older than :data:`STALE_S` seconds (``MS_DEEPSEEK_LEASE_STALE_S``: a holder
  on another node that died), and with ``train --take-over`` at once (the operator knows the holder is
  dead: a node that was powered off);
* released when the run ends, whatever the way (the file is removed if it is still this job's).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ms_deepseek.core.atomic import atomic_write_text
from ms_deepseek.core.errors import UserError

LEASE_FILE = ".lease"
RENEW_S = 30.0  # heartbeat period of the holder
STALE_S = 600.0  # a heartbeat older than this: the holder is presumed dead
STALE_ENV = "MS_DEEPSEEK_LEASE_STALE_S"


class LeaseHeld(UserError):
    """The run folder is held by another job (a refusal that must not clean anything up in the folder)."""


@dataclass(frozen=True)
class Holder:
    host: str
    pid: int
    started: float
    heartbeat: float
    token: str

    def describe(self, now: float) -> str:
        since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.started))
        return f"host {self.host} pid {self.pid} since {since}, last heartbeat {now - self.heartbeat:.0f} s ago"

    def to_json(self) -> str:
        return json.dumps(self.__dict__) + "\n"


def stale_after() -> float:
    value = os.environ.get(STALE_ENV, "").strip()
    try:
        return float(value) if value else STALE_S
    except ValueError:
        raise UserError(f"{STALE_ENV}={value!r}: expected seconds, e.g. {STALE_S:.0f}") from None


def read_holder(run_dir) -> Optional[Holder]:
    """The lease's holder; None when there is no lease (a damaged lease file is a lease of nobody)."""
    try:
        data = json.loads((Path(run_dir) / LEASE_FILE).read_text(encoding="utf-8"))
        return Holder(
            str(data["host"]), int(data["pid"]), float(data["started"]), float(data["heartbeat"]), str(data["token"])
        )
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError):
        return Holder("?", -1, 0.0, 0.0, "damaged")


def _pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs. A zombie (killed, its parent gone without reaping it: a worker of a job that ended
    after one of its workers died) answers ``kill(pid, 0)`` but holds nothing: its state in ``/proc/<pid>/stat``
    is Z (proc(5))."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no /proc here: kill's answer stands
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"  # the state follows the parenthesised command name


def _create(path: Path, text: str) -> bool:
    """Create ``path`` holding ``text`` in one step, False when it exists: the text goes to a temporary
    sibling linked to ``path`` (``link`` fails on an existing name, on NFS too), so no reader ever sees
    the lease empty."""
    tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex[:12]}.tmp")
    tmp.write_text(text, encoding="utf-8")
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    finally:
        tmp.unlink()


def host_name() -> str:
    return socket.gethostname()


def why_free(holder: Holder, now: float, take_over: bool) -> Optional[str]:
    """Why ``holder``'s lease may be taken ("" when silently), or None when it holds."""
    if holder.token == "damaged":
        return "the lease file was unreadable"
    if holder.host == host_name() and (holder.pid == os.getpid() or not _pid_alive(holder.pid)):
        return ""  # its process is gone (or is this one: an earlier run of this process)
    if now - holder.heartbeat > stale_after():
        return f"its heartbeat is {now - holder.heartbeat:.0f} s old (more than {STALE_ENV}={stale_after():.0f})"
    if take_over:
        return "--take-over"
    return None


def live_holder(run_dir, take_over: bool = False) -> Optional[Holder]:
    """The holder of ``run_dir``'s lease when it still holds it (what ``launch`` checks before starting)."""
    holder = read_holder(run_dir)
    if holder is None or why_free(holder, time.time(), take_over) is not None:
        return None
    return holder


def refusal(run_dir, holder: Holder) -> LeaseHeld:
    return LeaseHeld(
        f"--output {run_dir}: the run folder is held by another job ({holder.describe(time.time())}); wait for "
        f"it to end or choose another --output; if that job is dead, pass --take-over (or wait until its "
        f"heartbeat is {stale_after():.0f} s old)"
    )


class RunLease:
    """This job's lease of a run folder: :meth:`acquire`, a renewing thread, :meth:`check`, :meth:`release`."""

    def __init__(self, run_dir: Path, holder: Holder):
        self.run_dir, self.holder = Path(run_dir), holder
        self.path = self.run_dir / LEASE_FILE
        self.lost: Optional[Holder] = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew, name="run-lease", daemon=True)

    @classmethod
    def acquire(cls, run_dir, take_over: bool = False, say=print) -> "RunLease":
        """Take ``run_dir``'s lease, or LeaseHeld naming its live holder."""
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        now = time.time()
        mine = Holder(host_name(), os.getpid(), now, now, uuid.uuid4().hex)
        path = run_dir / LEASE_FILE
        if not _create(path, mine.to_json()):
            holder = read_holder(run_dir)
            why = why_free(holder, now, take_over) if holder is not None else ""
            if why is None:
                raise refusal(run_dir, holder)
            if why:
                say(f"run folder {run_dir}: taking over the lease of {holder.describe(now)}: {why}")
            atomic_write_text(path, mine.to_json())
        lease = cls(run_dir, mine)
        if read_holder(run_dir) != mine:  # another job took it in the same moment
            raise refusal(run_dir, read_holder(run_dir))
        lease.keep_renewed()
        return lease

    def keep_renewed(self) -> None:
        """Start the thread that renews the lease until :meth:`release`."""
        self._thread.start()

    def _renew(self) -> None:
        while not self._stop.wait(RENEW_S):
            self.renew()

    def renew(self) -> None:
        """One heartbeat: the lease's time renewed, unless another job holds it now (then it is lost)."""
        current = read_holder(self.run_dir)
        if current is not None and current.token != self.holder.token:
            self.lost = current
            self._stop.set()
            return
        self.holder = Holder(self.holder.host, self.holder.pid, self.holder.started, time.time(), self.holder.token)
        try:
            atomic_write_text(self.path, self.holder.to_json())
        except OSError:
            pass  # a full disk or a lost mount: the next beat tries again; the save reports the disk

    def check(self, read: bool = False) -> None:
        """UserError when another job took the lease over (seen by the heartbeat, or with ``read`` in the file
        now: before a save): this one stops before writing anything more."""
        if read and self.lost is None:
            current = read_holder(self.run_dir)
            if current is not None and current.token != self.holder.token:
                self.lost = current
        if self.lost is not None:
            raise UserError(
                f"--output {self.run_dir}: the run folder was taken over by another job "
                f"({self.lost.describe(time.time())}); this job stops without writing more"
            )

    def release(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        current = read_holder(self.run_dir)
        if current is not None and current.token == self.holder.token:
            try:
                self.path.unlink()
            except OSError:
                pass
