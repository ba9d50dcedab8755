"""The walk of one ``ms-deepseek`` command through the package's rooms: which rooms it enters, in what order,
and every call that goes back up a layer.

ARCHITECTURE.md orders the rooms in layers (``tests/repo/test_layers.py`` ``LAYERS`` is the table), and no
module imports a higher layer. A call can still go up: a function of a higher room handed down and called
back (a callback, a method of an object built above). This script runs the command in this process under
``sys.setprofile``, follows every call between two ``ms_deepseek`` modules, and prints

- the rooms in the order the walk first enters them;
- per room, how many times the walk entered it from another room;
- every call whose callee sits in a higher layer than its caller (caller function -> callee function, count),
  apart from the constructors (``__post_init__``, a field's default factory) of a higher room's dataclass that
  generic code below builds from a file (``core.schema.from_dict``), which are counted on their own line.

Worker processes the command starts (``plan --compile``'s compile workers, msrun's workers) are not followed.
Exit 0, or 1 with ``--no-upward`` when any call goes up::

    python tools/call_walk.py -- plan --recipe recipes/tiny-cpu.yaml --json
    python tools/call_walk.py --no-upward -- train recipes/tiny-cpu.yaml --set train.steps=2 -o /tmp/run
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import os
import sys
from collections import Counter
from pathlib import Path
from typing import Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_DIR = str(ROOT / "ms_deepseek")


def _layers() -> List[Tuple[str, ...]]:
    """The layer table the import test enforces: one table for both."""
    spec = importlib.util.spec_from_file_location("_layers_table", ROOT / "tests" / "repo" / "test_layers.py")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(ROOT / "tests" / "helpers"))  # test_layers imports repo_paths by its bare name
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(ROOT / "tests" / "helpers"))
    return module.LAYERS


def room_of(filename: str) -> Optional[str]:
    """``ms_deepseek/verification/compile/check.py`` -> ``verification``; None outside the package."""
    if not filename.startswith(PACKAGE_DIR + "/"):
        return None
    parts = filename[len(PACKAGE_DIR) + 1 :].split("/")
    return parts[0] if len(parts) > 1 else parts[0].removesuffix(".py")


class Walk:
    def __init__(self, layers: List[Tuple[str, ...]]):
        self.layer = {room: i for i, rooms in enumerate(layers, start=1) for room in rooms}
        self.order: List[str] = []
        self.entries: Counter = Counter()
        self.upward: Counter = Counter()
        self.built_up: Counter = Counter()  # a higher room's object built by generic code below (schema, dataclasses)

    def layer_of(self, room: str) -> int:
        return self.layer.get(room, 0)  # the package root (ms_deepseek/__init__.py): below every layer

    def profile(self, frame, event, arg):
        if event != "call":
            return
        callee = room_of(frame.f_code.co_filename)
        if callee is None:
            return
        caller_frame = frame.f_back
        while caller_frame is not None and room_of(caller_frame.f_code.co_filename) is None:
            caller_frame = caller_frame.f_back  # through library frames (a callback MindSpore or tqdm calls)
        if callee not in self.order:
            self.order.append(callee)
        if caller_frame is None:
            return
        caller = room_of(caller_frame.f_code.co_filename)
        if caller == callee:
            return
        self.entries[callee] += 1
        if self.layer_of(callee) > self.layer_of(caller):
            name = frame.f_code.co_name
            # a dunder, or a lambda a dataclass's generated __init__ calls (a field's default factory)
            factory = name == "<lambda>" and frame.f_back is not None and frame.f_back.f_code.co_name == "__init__"
            constructing = (name.startswith("__") and name.endswith("__")) or factory
            (self.built_up if constructing else self.upward)[(_where(caller_frame), _where(frame))] += 1


def _where(frame) -> str:
    path = frame.f_code.co_filename[len(PACKAGE_DIR) + 1 :]
    return f"{path}:{frame.f_code.co_name}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-upward", action="store_true", help="exit 1 when any call goes up a layer")
    parser.add_argument("--show-output", action="store_true", help="print the command's own output too")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the ms-deepseek command line, after --")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command after --, e.g. -- plan --recipe recipes/tiny-cpu.yaml")
    sys.path.insert(0, str(ROOT))
    # the worker processes the command starts import this checkout too
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    from ms_deepseek.cli import main as cli_main

    walk = Walk(_layers())
    out = io.StringIO()
    sys.setprofile(walk.profile)
    try:
        with contextlib.redirect_stdout(sys.stdout if args.show_output else out):
            code = cli_main(command)
    finally:
        sys.setprofile(None)
    print(f"ms-deepseek {' '.join(command)}: exit {code}")
    print("rooms, in the order entered: " + " -> ".join(walk.order))
    entries: Dict[str, int] = dict(walk.entries)
    print("entries from another room: " + ", ".join(f"{r} {entries.get(r, 0)}" for r in walk.order))
    print(
        f"constructors of a higher room's objects run by generic code below: {sum(walk.built_up.values())} "
        f"({', '.join(sorted({callee for _, callee in walk.built_up}))})"
    )
    print(f"calls up a layer: {sum(walk.upward.values())} ({len(walk.upward)} distinct)")
    for (caller, callee), n in walk.upward.most_common():
        print(f"  {caller} -> {callee}: {n}")
    return 1 if args.no_upward and walk.upward else 0


if __name__ == "__main__":
    sys.exit(main())
