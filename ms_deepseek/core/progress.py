"""Progress bars: tqdm, drawn only on a terminal; progress lines, written to a stream a command chooses.

A bar redraws itself with ``\\r`` frames; in a redirected log (``train ... > run.log 2>&1``,
a scheduler's output file) those frames pile up as one endless line. Every bar of the
package comes from :func:`progress_bar`, which draws only when its caller wants one and
the bar's stream (stderr, tqdm's default) is a terminal. ``MS_DEEPSEEK_QUIET=1`` turns
every bar off.
"""

from __future__ import annotations

import os
import sys


def interactive(stream=None) -> bool:
    """Whether ``stream`` (default: stderr, where bars go) is a terminal and bars are not turned off."""
    stream = sys.stderr if stream is None else stream
    if os.environ.get("MS_DEEPSEEK_QUIET") == "1":
        return False
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # a closed stream
        return False


def progress_bar(iterable=None, *, enabled: bool = True, **kwargs):
    """``tqdm(iterable, **kwargs)``, disabled unless ``enabled`` and its stream is a terminal.

    A disabled bar still counts (``update``, ``close`` work) and prints nothing."""
    from tqdm import tqdm

    stream = kwargs.get("file")
    return tqdm(iterable, disable=not (enabled and interactive(stream)), **kwargs)


def progress_line(stream, message: str) -> None:
    """One progress line on ``stream`` (a text file such as ``sys.stderr``; None: nowhere), flushed at once. Long
    work below the command line is given the stream, not a function of the command's, so that nothing it calls
    sits above it."""
    if stream is not None:
        print(message, file=stream, flush=True)
