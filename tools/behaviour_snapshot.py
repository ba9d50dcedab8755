"""Record what a user sees of the package, to compare two commits' behaviour byte for byte.

A restructuring must not change behaviour. This script writes, into one folder:

- ``help/<command>.txt``: ``ms-deepseek --help`` and every command's ``--help``;
- ``plan/<recipe>.json``: ``ms-deepseek plan --recipe R --json`` for every recipe in ``recipes/``;
- ``checkpoint.sha256``: the SHA-256 of every file a short ``train recipes/tiny-cpu.yaml`` run saves
  under ``checkpoints/``, ``state.json`` hashed without its one wall-clock field (``elapsed_s``, the counters'
  time so far: ``train.components.RunCounters``).

Run it from the root of each commit's checkout (with that checkout on ``PYTHONPATH``) and compare the folders::

    python tools/behaviour_snapshot.py /tmp/before     # at the old commit
    python tools/behaviour_snapshot.py /tmp/after      # at the new one
    python tools/behaviour_snapshot.py --compare /tmp/before /tmp/after

``--compare`` prints every file that differs and exits 1 when any does, 0 when all are identical, and
refuses two folders that hold different sets of files (a command or recipe added or lost).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path.cwd()  # the checkout being recorded: run the script from its root
# the state.json field that records how long the run took, not what it saved (components.run_state)
WALL_CLOCK_KEYS = ("elapsed_s",)


def _cli(args, cwd=ROOT, env=None):
    return subprocess.run(
        [sys.executable, "-m", "ms_deepseek.cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )


def _commands():
    from ms_deepseek.cli import COMMANDS

    return list(COMMANDS)


def _without_wall_clock(state: dict) -> dict:
    return {k: v for k, v in state.items() if k not in WALL_CLOCK_KEYS}


def snapshot(out: Path, steps: int) -> None:
    (out / "help").mkdir(parents=True, exist_ok=True)
    (out / "plan").mkdir(exist_ok=True)
    top = _cli(["--help"])
    (out / "help" / "ms-deepseek.txt").write_text(top.stdout + top.stderr)
    for name in _commands():
        res = _cli([name, "--help"])
        (out / "help" / f"{name}.txt").write_text(f"exit {res.returncode}\n{res.stdout}{res.stderr}")
        print(f"help {name}: exit {res.returncode}", flush=True)
    for recipe in sorted((ROOT / "recipes").glob("*.yaml")):
        res = _cli(["plan", "--recipe", str(recipe.relative_to(ROOT)), "--json"])
        (out / "plan" / f"{recipe.stem}.json").write_text(f"exit {res.returncode}\n{res.stdout}{res.stderr}")
        print(f"plan {recipe.stem}: exit {res.returncode}", flush=True)
    with tempfile.TemporaryDirectory(prefix="msd-snap-") as tmp:
        run = Path(tmp) / "run"
        res = _cli(
            ["train", "recipes/tiny-cpu.yaml", "--output", str(run), "--quiet"]
            + [
                "--set",
                f"train.steps={steps}",
                "--set",
                f"train.eval_interval={steps}",
                "--set",
                f"checkpoint.save_interval={steps}",
            ],
        )
        if res.returncode != 0:
            sys.exit(f"behaviour_snapshot: the training run failed (exit {res.returncode}):\n{res.stderr[-2000:]}")
        lines = []
        for path in sorted((run / "checkpoints").rglob("*")):
            if not path.is_file():
                continue
            rel = path.relative_to(run)
            data = path.read_bytes()
            if path.name == "state.json":
                data = json.dumps(_without_wall_clock(json.loads(data)), sort_keys=True).encode()
            lines.append(f"{hashlib.sha256(data).hexdigest()}  {rel}")
        if not lines:
            sys.exit(f"behaviour_snapshot: the training run saved no checkpoint under {run / 'checkpoints'}")
        (out / "checkpoint.sha256").write_text("\n".join(lines) + "\n")
        print(f"checkpoint: {len(lines)} files hashed", flush=True)


def compare(before: Path, after: Path) -> int:
    def files(root):
        return {p.relative_to(root) for p in root.rglob("*") if p.is_file()}

    a, b = files(before), files(after)
    if a != b:
        for rel in sorted(a - b):
            print(f"only in {before}: {rel}")
        for rel in sorted(b - a):
            print(f"only in {after}: {rel}")
        return 1
    if not a:
        print(f"nothing to compare: {before} is empty")
        return 1
    differ = [rel for rel in sorted(a) if (before / rel).read_bytes() != (after / rel).read_bytes()]
    for rel in differ:
        print(f"differs: {rel}")
    print(f"{len(a)} files compared, {len(differ)} differ")
    return 1 if differ else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="+", type=Path, help="OUT, or BEFORE AFTER with --compare")
    parser.add_argument("--compare", action="store_true", help="compare two snapshot folders")
    parser.add_argument("--steps", type=int, default=4, help="training steps before the checkpoint (default 4)")
    args = parser.parse_args()
    if args.compare:
        if len(args.folders) != 2:
            parser.error("--compare takes two folders: BEFORE AFTER")
        return compare(*args.folders)
    if len(args.folders) != 1:
        parser.error("one output folder (or --compare BEFORE AFTER)")
    os.environ.setdefault("GLOG_v", "3")
    snapshot(args.folders[0], args.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
