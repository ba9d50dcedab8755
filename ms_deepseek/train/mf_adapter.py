"""The one place that imports MindFormers, with its import side effects contained.

Importing MindFormers takes seconds and, on MindSpore 2.9 / MindFormers 1.9:

* writes log files under ``LOG_MF_PATH`` (``./output/log`` if unset): we point it at the
  run's log folder, as an absolute path (MindFormers glues it onto its logger's name, so a
  relative one shows up garbled in every line);
* prints warnings on stdout (``Import PyNativeDeepseekV3ForCausalLM failed: No module named
  'hyper_parallel'``) and makes MindSpore print ``mindspore.common.api is deprecated`` on
  stderr: at default verbosity both go to ``<log folder>/mindformers-import.log`` (file
  descriptors 1 and 2 are redirected while it imports, so output from C++ is caught too),
  and the stdout handlers MindFormers keeps on its loggers write there afterwards;
* replaces ``warnings.showwarning``: restored;
* its ``get_context()`` resets MindSpore to PyNative: import before setting the mode.

``--verbose`` (``MS_DEEPSEEK_VERBOSE=1``) leaves its output on the terminal.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from pathlib import Path
from typing import Optional

from ms_deepseek.core.runtime import is_verbose

_CLASSES = None
_LOG_FILE = None  # kept open: MindFormers' stream handlers keep writing to it


@contextlib.contextmanager
def _output_to(path: Path):
    """Send file descriptors 1 and 2 (and so sys.stdout / sys.stderr) to ``path`` for the block."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for f in (fd, *saved):
            os.close(f)


def _redirect_handlers(stream) -> None:
    """MindFormers' loggers (named ``mindformers<log path>``) keep a stdout handler: point it at ``stream``."""
    for name, logger in logging.Logger.manager.loggerDict.items():
        if not name.startswith("mindformers") or not isinstance(logger, logging.Logger):
            continue
        for handler in logger.handlers:
            if type(handler).__name__ == "LimitedRepeatHandler" or (
                isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler)
            ):
                handler.setStream(stream)


def mindformers_classes(log_dir: Optional[Path] = None) -> dict:
    """Import the MindFormers classes we use ({"CosineWithWarmUpLR": ...}), once per process.

    ``log_dir``: the run's log folder (default ``./logs``); MindFormers' logs go to ``log_dir/mindformers``.
    """
    global _CLASSES, _LOG_FILE
    if _CLASSES is not None:
        return _CLASSES
    log_dir = Path(log_dir if log_dir is not None else Path.cwd() / "logs").resolve()
    (log_dir / "mindformers").mkdir(parents=True, exist_ok=True)
    os.environ["LOG_MF_PATH"] = str(log_dir / "mindformers")
    import warnings

    saved = warnings.showwarning  # MindFormers replaces it on import
    if is_verbose():
        from mindformers.core.lr.lr_schedule import CosineWithWarmUpLR
    else:
        log_path = log_dir / "mindformers-import.log"
        with _output_to(log_path):
            from mindformers.core.lr.lr_schedule import CosineWithWarmUpLR
        _LOG_FILE = open(log_path, "a", buffering=1)  # noqa: SIM115 - lives as long as the process
        _redirect_handlers(_LOG_FILE)
    warnings.showwarning = saved
    _CLASSES = {"CosineWithWarmUpLR": CosineWithWarmUpLR}
    return _CLASSES
