"""The one door through which ``ms-deepseek doctor`` looks at the machine.

Every check that reads a system file, runs a tool (``npu-smi``, ``hccn_tool``,
``ip``, ``msrun``), reads an environment variable, asks for free disk space or
opens a socket does it through a :class:`SystemProbe`. Tests hand the checks a
:class:`RecordedProbe` instead, filled with outputs recorded on real hosts
(healthy and broken), so every verdict is exercised without an NPU.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Tuple


@dataclass
class CommandResult:
    """What a finished command left behind."""

    returncode: int
    stdout: str
    stderr: str = ""

    @property
    def ok(self) -> bool:
        return self.returncode == 0


class SystemProbe:
    """Reads the real machine."""

    def read_file(self, path: str) -> Optional[str]:
        """Text of ``path``, or None when it does not exist or cannot be read."""
        try:
            return Path(path).read_text(errors="replace")
        except OSError:
            return None

    def glob(self, pattern: str) -> List[str]:
        """Paths matching an absolute glob pattern, sorted."""
        import glob as _glob

        return sorted(_glob.glob(pattern))

    def which(self, tool: str) -> Optional[str]:
        """Full path of ``tool`` on PATH (also the Ascend driver's tool folders), or None."""
        found = shutil.which(tool)
        if found:
            return found
        for folder in ("/usr/local/sbin", "/usr/local/bin", "/usr/local/Ascend/driver/tools"):
            candidate = os.path.join(folder, tool)
            if os.access(candidate, os.X_OK):
                return candidate
        return None

    def run(
        self,
        argv: Sequence[str],
        timeout: float = 60.0,
        env: Optional[Mapping[str, str]] = None,
        cwd: Optional[str] = None,
    ) -> Optional[CommandResult]:
        """Run ``argv``; None when the program does not exist. A timeout is returncode 124."""
        exe = self.which(argv[0]) if not os.path.isabs(argv[0]) else argv[0]
        if exe is None or not os.path.exists(exe):
            return None
        full_env = None
        if env is not None:
            full_env = dict(os.environ)
            full_env.update(env)
        try:
            proc = subprocess.run(
                [exe, *argv[1:]],
                capture_output=True,
                text=True,
                timeout=timeout,
                env=full_env,
                cwd=cwd,
                errors="replace",
            )
        except subprocess.TimeoutExpired as exc:
            out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            return CommandResult(124, out, f"timed out after {timeout:.0f} s")
        except OSError as exc:
            return CommandResult(127, "", str(exc))
        return CommandResult(proc.returncode, proc.stdout, proc.stderr)

    def env(self, name: str) -> Optional[str]:
        return os.environ.get(name)

    def disk_free(self, path: str) -> Optional[Tuple[str, int]]:
        """(existing folder examined, free bytes) for ``path`` or its nearest existing parent."""
        p = Path(path).expanduser().absolute()
        while not p.exists():
            if p.parent == p:
                return None
            p = p.parent
        try:
            return str(p), shutil.disk_usage(p).free
        except OSError:
            return None

    def tcp_probe(self, host: str, port: int, timeout: float = 3.0) -> str:
        """Reachability of ``host``: 'open', 'refused' (the host answered), 'unresolved', 'timeout'
        or 'unreachable: <reason>'."""
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except socket.gaierror:
            return "unresolved"
        family, kind, proto, _, addr = infos[0]
        with socket.socket(family, kind, proto) as sock:
            sock.settimeout(timeout)
            try:
                sock.connect(addr)
                return "open"
            except ConnectionRefusedError:
                return "refused"
            except socket.timeout:
                return "timeout"
            except OSError as exc:
                return f"unreachable: {exc.strerror or exc}"

    def local_addresses(self) -> List[str]:
        """IP addresses of this host (for "am I the master?")."""
        addrs = {"127.0.0.1", "::1", "localhost"}
        try:
            name = socket.gethostname()
            addrs.add(name)
            for info in socket.getaddrinfo(name, None):
                addrs.add(info[4][0])
        except OSError:
            pass
        result = self.run(["hostname", "-I"], timeout=5)
        if result is not None and result.ok:
            addrs.update(result.stdout.split())
        return sorted(addrs)


class RecordedProbe(SystemProbe):
    """A probe that answers from recorded outputs (tests, or replaying a host's capture).

    ``files`` maps absolute paths to their text; ``commands`` maps the command line
    (arguments joined by single spaces) to a :class:`CommandResult` or to its stdout;
    a command that is not recorded does not exist (``run`` returns None), and a tool
    counts as installed when some recorded command starts with it.
    """

    def __init__(
        self,
        files: Optional[Dict[str, str]] = None,
        commands: Optional[Dict[str, object]] = None,
        env: Optional[Dict[str, str]] = None,
        disk: Optional[Dict[str, int]] = None,
        tcp: Optional[Dict[str, str]] = None,
        addresses: Sequence[str] = ("127.0.0.1",),
    ):
        self.files = dict(files or {})
        self.commands = {
            k: (v if isinstance(v, CommandResult) else CommandResult(0, str(v))) for k, v in (commands or {}).items()
        }
        self.environ = dict(env or {})
        self.disk = dict(disk or {})
        self.tcp = dict(tcp or {})
        self.addresses = list(addresses)
        self.calls: List[str] = []

    @classmethod
    def from_dir(cls, folder: Path, base: Optional["RecordedProbe"] = None) -> "RecordedProbe":
        """Load ``probe.json`` ({"files": {path: fixture file}, "commands": {cmd: fixture file | {rc, stdout}},
        "env": {...}, "disk": {...}, "tcp": {...}}) from ``folder``, over the contents of ``base``."""
        folder = Path(folder)
        spec = json.loads((folder / "probe.json").read_text())
        probe = cls(
            files=dict(base.files) if base else None,
            commands=dict(base.commands) if base else None,
            env=dict(base.environ) if base else None,
            disk=dict(base.disk) if base else None,
            tcp=dict(base.tcp) if base else None,
            addresses=base.addresses if base else ("127.0.0.1",),
        )

        def text(ref: str) -> str:
            return (folder / ref).read_text()

        for path, ref in spec.get("files", {}).items():
            if ref is None:
                probe.files.pop(path, None)
            else:
                probe.files[path] = text(ref)
        for cmd, ref in spec.get("commands", {}).items():
            if ref is None:
                probe.commands.pop(cmd, None)
            elif isinstance(ref, dict):
                out = text(ref["stdout_file"]) if "stdout_file" in ref else ref.get("stdout", "")
                probe.commands[cmd] = CommandResult(int(ref.get("rc", 0)), out, ref.get("stderr", ""))
            else:
                probe.commands[cmd] = CommandResult(0, text(ref))
        for name, value in spec.get("env", {}).items():
            if value is None:
                probe.environ.pop(name, None)
            else:
                probe.environ[name] = str(value)
        probe.disk.update({k: int(v) for k, v in spec.get("disk", {}).items()})
        probe.tcp.update(spec.get("tcp", {}))
        if "addresses" in spec:
            probe.addresses = list(spec["addresses"])
        return probe

    def read_file(self, path: str) -> Optional[str]:
        self.calls.append(f"read {path}")
        return self.files.get(path)

    def glob(self, pattern: str) -> List[str]:
        import fnmatch

        return sorted(p for p in self.files if fnmatch.fnmatch(p, pattern))

    def which(self, tool: str) -> Optional[str]:
        if any(cmd == tool or cmd.startswith(tool + " ") for cmd in self.commands):
            return f"/usr/local/bin/{tool}"
        return None

    def run(
        self,
        argv: Sequence[str],
        timeout: float = 60.0,
        env: Optional[Mapping[str, str]] = None,
        cwd: Optional[str] = None,
    ) -> Optional[CommandResult]:
        words = [str(a) for a in argv]
        if words and words[0] == sys.executable:  # recorded as plain "python"
            words[0] = "python"
        key = " ".join(words)
        self.calls.append(f"run {key}")
        return self.commands.get(key)

    def env(self, name: str) -> Optional[str]:
        return self.environ.get(name)

    def disk_free(self, path: str) -> Optional[Tuple[str, int]]:
        best = None
        target = str(Path(path).expanduser().absolute())
        for prefix, free in self.disk.items():
            if target == prefix or target.startswith(prefix.rstrip("/") + "/"):
                if best is None or len(prefix) > len(best[0]):
                    best = (prefix, free)
        return best

    def tcp_probe(self, host: str, port: int, timeout: float = 3.0) -> str:
        return self.tcp.get(f"{host}:{port}", self.tcp.get(host, "timeout"))

    def local_addresses(self) -> List[str]:
        return list(self.addresses)
