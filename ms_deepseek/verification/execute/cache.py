"""Reuse of ``plan --execute``'s one-device run between runs that would compute it alike.

The one-device run (:mod:`.one_device`) is a function of what it is given: the recipe as loaded with its
overrides, the files those name (the random checkpoint, an SFT folder), the global batches, the step count, the
layout's expert-parallel degree (its balance losses), its environment's operator choice, the package's own code,
any ``sitecustomize`` module on its ``PYTHONPATH`` and the MindSpore release. :func:`key` hashes all of them, so a
run whose inputs differ in any of them gets a key of its own; runs that differ only in what the ranks compile (a
planted mistake in the compile workers, another rank layout with the same reduced one-device recipe) share it.

Opt-in: ``MS_DEEPSEEK_EXECUTE_CACHE=DIR`` names the folder (the test suite sets one per session); unset, every run
trains its own one device. An entry is written to a temporary folder and renamed into place, so a failed or
interrupted run leaves none half-written.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Dict, Iterable, Optional

import numpy as np

ENV = "MS_DEEPSEEK_EXECUTE_CACHE"
# what the one-device run writes (one_device.run): its step outputs and every tensor before and after each step
_OUTPUTS = ("result.json", "values_*.safetensors")


def folder() -> Optional[Path]:
    value = os.environ.get(ENV)
    return Path(value) if value else None


def _digest_path(path: Path, h) -> None:
    """A file's bytes, or a folder's files (relative names and bytes, in name order)."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    for f in files:
        h.update(str(f.relative_to(path) if f != path else f.name).encode())
        h.update(f.read_bytes())


def _digest_value(value, h) -> None:
    """A loaded recipe's value: a string naming an existing file or folder counts by its content, not its path (the
    random checkpoint and the chat corpus live in per-run folders)."""
    if isinstance(value, dict):
        for k in sorted(value):
            h.update(str(k).encode())
            _digest_value(value[k], h)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _digest_value(v, h)
    elif isinstance(value, str) and value and os.path.exists(value):
        _digest_path(Path(value), h)
    else:
        h.update(repr(value).encode())


def _package_files() -> Iterable[Path]:
    package = Path(__file__).resolve().parents[1]
    return sorted(p for p in package.rglob("*") if p.is_file() and "__pycache__" not in p.parts)


def key(recipe, batches: Dict[str, np.ndarray], request: Dict, env: Dict[str, str]) -> str:
    """The one-device run's identity (module docstring): ``recipe`` as the run will load it, ``batches`` as written
    to its ``batches.npz``, ``request`` the rest of its request (its recipe counts through ``recipe``), ``env`` the
    run's environment."""
    import dataclasses

    import mindspore

    h = hashlib.sha256()
    built = dataclasses.asdict(recipe)
    # the recipe as built counts; what it was built from does not (its overrides name the per-run folders by path)
    built.pop("origin", None)
    _digest_value(built, h)
    for name in sorted(batches):
        h.update(name.encode())
        h.update(np.ascontiguousarray(batches[name]).tobytes())
    h.update(
        json.dumps({k: v for k, v in request.items() if k not in ("recipe", "overrides")}, sort_keys=True).encode()
    )
    h.update(json.dumps({k: env.get(k) for k in ("MS_DEEPSEEK_OPS", "MS_DEEPSEEK_DEVICE")}).encode())
    h.update(f"{mindspore.__version__} {sys.version}".encode())
    for path in _package_files():
        _digest_path(path, h)
    for entry in filter(None, env.get("PYTHONPATH", "").split(os.pathsep)):
        site = Path(entry) / "sitecustomize.py"
        if site.is_file():
            _digest_path(site, h)
    return h.hexdigest()[:32]


def restore(cache_key: str, out: Path) -> bool:
    """Copy a stored one-device run into ``out``; False when there is none."""
    root = folder()
    entry = root / cache_key if root else None
    if entry is None or not (entry / "result.json").is_file():
        return False
    for pattern in _OUTPUTS:
        for f in entry.glob(pattern):
            shutil.copyfile(f, out / f.name)
    return True


def store(cache_key: str, out: Path) -> None:
    """Keep a finished one-device run's outputs under its key (no-op without a cache folder)."""
    root = folder()
    if root is None or (root / cache_key).is_dir():
        return
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".partial-", dir=root))
    try:
        for pattern in _OUTPUTS:
            for f in out.glob(pattern):
                shutil.copyfile(f, tmp / f.name)
        os.rename(tmp, root / cache_key)
    except OSError:  # another run stored the same key first: its entry is the same run
        shutil.rmtree(tmp, ignore_errors=True)
