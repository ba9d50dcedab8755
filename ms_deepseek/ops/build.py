"""Build the CPU kernels with g++ on first use, into a cache keyed by source hash.

Sources ship with the package as ``ms_deepseek/ops_src`` (a link to the top-level
``ops/`` folder in the repository; setuptools copies the files into wheels).
Each operator is one shared library built from ``ops/<op>/cpu/<op>_cpu.cc`` with
the shared headers (``ops/common``, ``ops/<op>/common``). The cache folder is
``$MS_DEEPSEEK_OPS_CACHE`` or ``~/.cache/ms_deepseek/ops``; a library lands at
``<cache>/<op>-<hash>/lib<op>_cpu.so``, where the hash covers every source byte,
the compiler command and the compiler version. The compiler writes a private
temporary file that is renamed into place, so two processes building at once
both succeed and nobody loads a half-written library.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import uuid
from pathlib import Path
from typing import List

CACHE_ENV = "MS_DEEPSEEK_OPS_CACHE"
CXX_ENV = "MS_DEEPSEEK_CXX"
CXX_FLAGS = ["-std=c++17", "-O2", "-shared", "-fPIC", "-pthread", "-Wall", "-Wno-unused-parameter"]
BUILD_TIMEOUT_S = 300


class KernelBuildError(RuntimeError):
    """A CPU kernel could not be compiled (no compiler, compile error, missing source)."""


def source_root() -> Path:
    """The kernel source tree shipped with the package (``ops/`` in the repository)."""
    return Path(__file__).resolve().parents[1] / "ops_src"


def cache_root() -> Path:
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "ms_deepseek" / "ops"


def compiler() -> str:
    return os.environ.get(CXX_ENV, "g++")


def kernel_sources(op_name: str, root: Path = None) -> List[Path]:
    """The .cc entry file first, then every header it may include (sorted)."""
    root = source_root() if root is None else root
    entry = root / op_name / "cpu" / f"{op_name}_cpu.cc"
    if not entry.is_file():
        raise KernelBuildError(f"{op_name}: kernel source {entry} not found")
    headers = sorted((root / "common").glob("*.h")) + sorted((root / op_name / "common").glob("*.h"))
    return [entry] + headers


@functools.lru_cache(maxsize=None)
def _compiler_version(cxx: str) -> str:
    if shutil.which(cxx) is None:
        raise KernelBuildError(f"C++ compiler {cxx!r} not found on PATH (set {CXX_ENV} to use another)")
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60, check=True)
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelBuildError(f"C++ compiler {cxx!r} does not run: {exc}") from exc
    return out.stdout.strip()


def _command(cxx: str, op_name: str, root: Path, output: Path) -> List[str]:
    includes = [f"-I{root / 'common'}", f"-I{root / op_name / 'common'}"]
    return [cxx, *CXX_FLAGS, *includes, "-o", str(output), str(root / op_name / "cpu" / f"{op_name}_cpu.cc")]


def library_path(op_name: str, root: Path = None) -> Path:
    """Where the library for the current sources and compiler lives (built or not)."""
    root = source_root() if root is None else root
    cxx = compiler()
    digest = hashlib.sha256()
    digest.update(_compiler_version(cxx).encode())
    digest.update(" ".join(_command(cxx, op_name, Path("ROOT"), Path("OUT"))).encode())
    for path in kernel_sources(op_name, root):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return cache_root() / f"{op_name}-{digest.hexdigest()[:16]}" / f"lib{op_name}_cpu.so"


def build(op_name: str, root: Path = None) -> Path:
    """Return the path of the operator's CPU library, compiling it if needed."""
    root = source_root() if root is None else root
    target = library_path(op_name, root)
    if target.is_file():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise KernelBuildError(f"{op_name}: cannot create cache folder {target.parent}: {exc}") from exc
    tmp = target.parent / f".{target.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp"
    cmd = _command(compiler(), op_name, root, tmp)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if proc.returncode != 0:
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-20:])
            raise KernelBuildError(f"{op_name}: g++ failed ({' '.join(cmd)}):\n{tail}")
        os.replace(tmp, target)  # atomic: concurrent builders produce identical bytes
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelBuildError(f"{op_name}: build failed: {exc}") from exc
    finally:
        if tmp.exists():
            tmp.unlink()
    return target
