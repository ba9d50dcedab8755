"""The one atomic writer for checkpoint folders (training saves, conversions, resharding).

A folder is written into a temporary sibling (``.<name>.partial-<id>``), every file in it
and the folder itself are fsynced, and it is swapped in: in one step where the kernel can
(``RENAME_EXCHANGE``); elsewhere (NFS) an existing destination is first renamed aside to
``.<name>.old-<id>`` (the same ``<id>`` as the temporary folder's), then the new folder renamed
into place, then the old one removed. At no moment is there no complete folder at the
destination's name or aside; on any error (or Ctrl-C) the temporary folder is removed and the
destination is untouched. A writer killed between the two renames leaves ``.old-<id>`` and
``.partial-<id>`` and no destination: :func:`restore_interrupted` (run by every cleanup) puts the
new, complete folder in place (an ``.old-<id>`` exists only once the writer called :func:`install`,
which it does only with a finished, fsynced folder).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import uuid
from pathlib import Path
from typing import Iterator, Optional

from ms_deepseek.core.errors import UserError
from ms_deepseek.core.safe_io import check_output_dir, is_inside

PARTIAL = ".partial-"
OLD = ".old-"


def fsync_path(path: Path) -> None:
    """fsync one file or folder (best effort on file systems that refuse it for folders)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_tree(folder: Path) -> None:
    """Every file and folder under ``folder``, deepest first, then ``folder`` itself."""
    for root, _dirs, files in os.walk(folder, topdown=False):
        for f in files:
            fsync_path(Path(root) / f)
        fsync_path(Path(root))


def check_apart(dst: Path, inputs, what: str = "destination") -> None:
    """Refuse a ``dst`` that is, holds or lies inside any of ``inputs`` (None entries are skipped): replacing it
    would delete (or write into) what the command reads."""
    for src in inputs:
        if src is None or not os.path.lexists(src):
            continue
        if os.path.realpath(src) == os.path.realpath(dst):
            raise UserError(f"{dst}: the {what} is the input folder {src}; choose another folder")
        if is_inside(dst, src):
            raise UserError(f"{dst}: the {what} lies inside the input folder {src}; choose a folder outside it")
        if is_inside(src, dst):
            raise UserError(f"{dst}: the {what} holds the input folder {src}; choose a folder outside it")


def check_destination(src: Optional[Path], dst: Path, overwrite: bool) -> None:
    """Refuse a destination that is the source, holds it, lies inside it, is a file, is a non-empty folder
    without overwrite, or cannot be written."""
    if src is not None and os.path.realpath(src) == os.path.realpath(dst):
        raise UserError(f"{dst}: the destination is the source folder")
    if src is not None and is_inside(dst, src):  # the output would pollute (and be read back as) the source
        raise UserError(f"{dst}: the destination lies inside the source folder {src}; choose a folder outside it")
    if dst.is_symlink() or dst.exists():
        if not dst.is_dir() or dst.is_symlink():
            raise UserError(f"{dst}: destination exists and is not a folder")
        if any(dst.iterdir()):
            if not overwrite:
                raise UserError(f"{dst}: destination exists and is not empty (pass --overwrite to replace it)")
            real_dst = os.path.realpath(dst)
            if src is not None and os.path.commonpath([real_dst, os.path.realpath(src)]) == real_dst:
                raise UserError(f"{dst}: destination holds the source folder; refusing to overwrite it")
    check_output_dir(dst, "destination folder")


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux ``renameat2(RENAME_EXCHANGE)``); False where unsupported."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def install(tmp: Path, dst: Path) -> None:
    """Rename the finished temporary folder to ``dst``.

    An existing non-empty ``dst`` is swapped with the new folder in one step where the kernel
    can (``RENAME_EXCHANGE``), else renamed aside first; the old copy is removed only after the
    new one is in place."""
    old: Optional[Path] = None
    if dst.is_dir() and not dst.is_symlink() and any(dst.iterdir()) and _exchange(tmp, dst):
        fsync_path(dst.parent)
        shutil.rmtree(tmp, ignore_errors=True)  # now the old folder
        return
    if dst.exists():
        if dst.is_dir() and any(dst.iterdir()):
            # the id of the temporary folder, so restore_interrupted can pair the two after a crash
            prefix = f".{dst.name}{PARTIAL}"
            tag = tmp.name[len(prefix) :] if tmp.name.startswith(prefix) else uuid.uuid4().hex[:12]
            old = dst.parent / f".{dst.name}{OLD}{tag}"
            os.rename(dst, old)
            fsync_path(dst.parent)
        else:
            os.rmdir(dst)
    try:
        os.rename(tmp, dst)
    except BaseException:
        if old is not None:
            os.rename(old, dst)
        raise
    fsync_path(dst.parent)  # the rename is durable before the old copy goes
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _owner_tag() -> str:
    # host and pid of the writer, so a later writer can tell a crashed one's leftovers from a live one's
    host = socket.gethostname().split(".")[0].replace("-", "_") or "host"
    return f"{host}-{os.getpid()}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def restore_interrupted(folder: Path, name: Optional[str] = None) -> list:
    """Finish the swaps that a crash between :func:`install`'s two renames left undone, in ``folder`` (only
    for destination ``name`` when given): with no destination, the new copy (``.partial-<id>``) is renamed in,
    or the old one (``.old-<id>``) back when the new is gone; an ``.old-`` copy beside its destination is
    removed. Returns the destinations restored."""
    restored = []
    try:
        children = sorted(Path(folder).iterdir())
    except OSError:
        return restored
    for old in children:
        if not old.name.startswith(".") or OLD not in old.name or not old.is_dir() or old.is_symlink():
            continue
        dst_name, tag = old.name[1:].rsplit(OLD, 1)
        if name is not None and dst_name != name:
            continue
        parts = tag.split("-")
        if (
            len(parts) == 3
            and parts[1].isdigit()
            and int(parts[1]) != os.getpid()
            and _pid_alive(int(parts[1]))
            and parts[0] == _owner_tag().rsplit("-", 1)[0]
        ):
            continue  # its writer is still at work between the two renames
        dst = old.parent / dst_name
        new = old.parent / f".{dst_name}{PARTIAL}{tag}"
        if os.path.lexists(dst):
            shutil.rmtree(old, ignore_errors=True)  # crashed after the swap, before removing the old copy
            continue
        if new.is_dir() and not new.is_symlink():
            os.rename(new, dst)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(old, dst)
        fsync_path(old.parent)
        restored.append(dst)
    return restored


def remove_stale_partials(dst: Path) -> list:
    """Remove ``.<dst name>.partial-<host>-<pid>-<id>`` folders whose writer (on this host) is gone: what a
    conversion or save killed with SIGKILL left behind. Live writers' and other hosts' folders are kept."""
    dst = Path(dst)
    removed = []
    restore_interrupted(dst.parent, dst.name)  # a complete copy of an interrupted swap is kept, not removed
    prefix = f".{dst.name}{PARTIAL}"
    host = _owner_tag().rsplit("-", 1)[0]
    try:
        children = list(dst.parent.iterdir())
    except OSError:
        return removed
    for child in children:
        if not child.name.startswith(prefix) or not child.is_dir() or child.is_symlink():
            continue
        parts = child.name[len(prefix) :].split("-")
        if len(parts) != 3 or parts[0] != host or not parts[1].isdigit():
            continue
        if int(parts[1]) != os.getpid() and not _pid_alive(int(parts[1])):
            shutil.rmtree(child, ignore_errors=True)
            removed.append(child)
    return removed


def atomic_write_text(path: Path, text: str, fsync: bool = True) -> None:
    """Replace the small file ``path`` in one step (a temporary sibling, fsynced, renamed over it, the folder
    fsynced): a reader sees the old text or the new, never a half-written file. ``fsync=False`` keeps the
    one-step replace and skips both fsyncs, for a file rewritten every step that only live readers need
    (a heartbeat): a host crash may lose the last write, never leave half of one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}{PARTIAL}{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
            if fsync:
                fh.flush()
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    if fsync:
        fsync_path(path.parent)


def temporary_sibling(dst: Path) -> Path:
    """A fresh temporary sibling of ``dst``; stale ones of the same destination are removed first."""
    remove_stale_partials(dst)
    return dst.parent / f".{dst.name}{PARTIAL}{_owner_tag()}-{uuid.uuid4().hex[:12]}"


@contextlib.contextmanager
def atomic_folder(dst, fsync: bool = True) -> Iterator[Path]:
    """``with atomic_folder(dst) as tmp:`` write into ``tmp``; on success it becomes ``dst``, on error it is gone."""
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_sibling(dst)
    tmp.mkdir()  # not tempfile.mkdtemp: the result keeps the user's umask, not mode 0700
    try:
        yield tmp
        if fsync:
            fsync_tree(tmp)
        install(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def remove_partials(folder: Path) -> list:
    """Temporary / aside folders left in ``folder`` by a writer that crashed (after restoring the complete copy
    of a swap it left half done)."""
    removed = []
    restore_interrupted(folder)
    if Path(folder).is_dir():
        for child in Path(folder).iterdir():
            if (
                child.is_dir()
                and child.name.startswith(".")
                and (PARTIAL in child.name or OLD in child.name or child.name.startswith(".tmp_"))
            ):
                shutil.rmtree(child, ignore_errors=True)
                removed.append(child)
    return removed
