"""Reading and writing what a user hands us, so that bad input is one line, never a traceback.

One place for the checks every command needs:

* :func:`json_loads` / :func:`yaml_load`: a document nested deeper than Python's
  parsers can recurse ends in ``RecursionError``; here it is a :class:`UserError`
  naming the file (and line, for jsonl).
* :func:`regular_file`: a FIFO or device given as an input file would block
  ``open()`` forever (a FIFO) or stream endlessly (``/dev/zero``); refuse it first.
* :func:`confined`: a path named *inside* a folder (``meta.json``'s ``lengths_file``,
  an index's shard names) must stay inside that folder.
* :func:`check_output_file` / :func:`check_output_dir`: before any data is built,
  make sure the destination can be written (not under ``/proc``/``/sys``, no parent
  that is a file, a file where a folder is wanted, or the reverse).

The command line's ``type=`` validators are in :mod:`ms_deepseek.cli.args`.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import tempfile
from pathlib import Path
from typing import Any, Optional, Union

from ms_deepseek.core.errors import UserError

PathLike = Union[str, Path]

_NESTING = "nested too deeply to parse (a JSON/YAML document this deep is not a real config)"


# ---------------------------------------------------------------------------- parsing
def json_loads(text: Union[str, bytes], where: PathLike) -> Any:
    """``json.loads`` whose only new failure is a UserError for runaway nesting; the caller
    keeps handling ``json.JSONDecodeError`` as before."""
    try:
        return json.loads(text)
    except RecursionError:
        raise UserError(f"{where}: {_NESTING}") from None


def yaml_load(text: str, where: PathLike) -> Any:
    """``yaml.safe_load`` with runaway nesting turned into a UserError naming ``where``."""
    import yaml

    try:
        return yaml.safe_load(text)
    except RecursionError:
        raise UserError(f"{where}: {_NESTING}") from None


# ---------------------------------------------------------------------------- input files
def regular_file(path: PathLike, what: str = "file") -> Path:
    """``path`` if it is a regular file (symlinks followed); UserError otherwise.

    Called before ``open()``: opening a FIFO for reading blocks until a writer appears,
    which for a mistyped path is forever."""
    path = Path(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise UserError(f"{path}: no such {what}") from None
    except OSError as exc:
        raise UserError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if stat.S_ISDIR(st.st_mode):
        raise UserError(f"{path}: is a folder, expected a {what}")
    if not stat.S_ISREG(st.st_mode):
        kind = "a FIFO" if stat.S_ISFIFO(st.st_mode) else "a socket" if stat.S_ISSOCK(st.st_mode) else "a device"
        raise UserError(f"{path}: is {kind}, not a regular {what}")
    return path


def is_file(path: PathLike, key: str) -> bool:
    """``Path.is_file`` for a name taken from an input file: a name the file system cannot hold
    (longer than NAME_MAX, ``ENAMETOOLONG``) is a UserError naming ``key``, not an OSError."""
    try:
        return Path(path).is_file()
    except OSError as exc:
        raise UserError(f"{key}: cannot look up {str(path)[:120]!r} ({exc.strerror or exc})") from None


def confined(folder: PathLike, name: Any, key: str) -> Path:
    """``folder / name`` when ``name`` is a relative path that stays inside ``folder``
    (symlinks resolved); UserError naming ``key`` otherwise."""
    folder = Path(folder)
    if not isinstance(name, str) or not name:
        raise UserError(f"{key}: expected a file name inside {folder}, got {name!r}")
    if os.path.isabs(name):
        raise UserError(f"{key}: {name!r} is an absolute path; it must name a file inside {folder}")
    target = folder / name
    base = os.path.realpath(folder)
    real = os.path.realpath(target)
    if os.path.commonpath([base, real]) != base:
        raise UserError(f"{key}: {name!r} points outside {folder}")
    return target


# ---------------------------------------------------------------------------- outputs
_PSEUDO_FS = ("/proc", "/sys", "/dev")


def _pseudo(path: Path) -> Optional[str]:
    real = os.path.realpath(path)
    for root in _PSEUDO_FS:
        if real == root or real.startswith(root + os.sep):
            return root
    return None


def _probe_dir(folder: Path, shown: Path) -> None:
    """Create and remove a file in the existing folder ``folder``: the only honest
    writability test (``os.access`` says yes to root everywhere, read-only mounts included)."""
    try:
        fd, name = tempfile.mkstemp(prefix=".ms-deepseek-write-test-", dir=folder)
    except OSError as exc:
        reason = exc.strerror or str(exc)
        if exc.errno in (errno.EROFS,):
            reason = "read-only file system"
        raise UserError(f"{shown}: cannot write into {folder} ({reason})") from None
    os.close(fd)
    os.unlink(name)


def _existing_ancestor(path: Path, shown: Path) -> Path:
    """The nearest existing ancestor of ``path``; UserError if it is not a folder."""
    parent = path.parent
    while not parent.exists():
        if parent == parent.parent:
            break
        parent = parent.parent
    if not parent.is_dir():
        raise UserError(f"{shown}: cannot be created, {parent} is a file, not a folder")
    return parent


def check_output_file(path: PathLike, what: str = "output file") -> Path:
    """Fail now, naming ``path``, if a file cannot be written there later."""
    path = Path(path)
    root = _pseudo(path)
    if root:
        raise UserError(f"{path}: cannot write a {what} under {root} (a kernel pseudo file system)")
    if path.is_dir():
        raise UserError(f"{path}: is a folder; the {what} must be a file path")
    if path.exists() and not path.is_file():
        raise UserError(f"{path}: exists and is not a regular file")
    _probe_dir(_existing_ancestor(path, path), path)
    return path


def check_output_dir(path: PathLike, what: str = "output folder") -> Path:
    """Fail now, naming ``path``, if a folder cannot be created or written there later."""
    path = Path(path)
    root = _pseudo(path)
    if root:
        raise UserError(f"{path}: cannot write a {what} under {root} (a kernel pseudo file system)")
    if path.exists():
        if not path.is_dir():
            raise UserError(f"{path}: is a file; the {what} must be a folder")
        _probe_dir(path, path)
    else:
        _probe_dir(_existing_ancestor(path, path), path)
    return path


def is_inside(inner: PathLike, outer: PathLike) -> bool:
    """True when ``inner`` is ``outer`` or lies below it (symlinks resolved)."""
    a, b = os.path.realpath(inner), os.path.realpath(outer)
    return a == b or a.startswith(b.rstrip(os.sep) + os.sep)


def created_parents(path: PathLike) -> list:
    """The ancestors of ``path`` that do not exist yet, outermost first: what a command
    that creates ``path`` with ``parents=True`` must remove again if it fails."""
    path = Path(path).absolute()
    missing = []
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        missing.append(parent)
        parent = parent.parent
    return list(reversed(missing))


def remove_empty_dirs(folders) -> None:
    """Remove the given folders, innermost first, as long as they are empty."""
    for folder in sorted(folders, key=lambda p: len(str(p)), reverse=True):
        try:
            os.rmdir(folder)
        except OSError:
            pass
