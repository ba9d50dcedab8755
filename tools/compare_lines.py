"""Compare what the tests marked ``lines`` found on two MindSpore lines (tests/helpers/lines.py).

    python tools/compare_lines.py .lines/2.9 .lines/2.10

Each folder holds one JSON file per result (``MS_DEEPSEEK_LINE_RESULTS`` of a pytest run). Every result must be on
both sides: a result one line lacks (a test skipped, failed or not run there) fails, and so do two empty folders.
Strings, integers, booleans and the structure must be equal; a float may differ by ``SPACINGS`` float32 spacings at
its magnitude (the results are float32 quantities printed as float64, and the two releases may round one
operation differently), and the output counts the values that needed it. A NaN or an infinity fails. Exit 0 when
the lines agree, 1 when they differ, 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Dict, List, Tuple

import numpy as np

SPACINGS = 4


def _load(folder: Path) -> Dict[str, dict]:
    if not folder.is_dir():
        raise SystemExit(f"compare_lines: {folder}: no such folder")
    out = {}
    for path in sorted(folder.glob("*.json")):
        try:
            data = json.loads(path.read_text())
            out[data["name"]] = data
        except (ValueError, KeyError, TypeError) as e:
            raise SystemExit(f"compare_lines: {path}: not a line result ({e})") from None
    return out


def compare_values(a, b, where: str, allowed: List[str]) -> List[str]:
    """Differences between ``a`` and ``b`` (one line each, naming the path); floats within SPACINGS float32 spacings
    are equal, and each one that needed it is appended to ``allowed``."""
    if isinstance(a, bool) or isinstance(b, bool) or a is None or b is None or isinstance(a, str):
        return [] if a == b and type(a) is type(b) else [f"{where}: {a!r} against {b!r}"]
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        if not (math.isfinite(a) and math.isfinite(b)):
            return [f"{where}: not a finite number: {a!r} against {b!r}"]
        if a == b:
            return []
        if isinstance(a, int) and isinstance(b, int):
            return [f"{where}: {a} against {b}"]
        allowance = SPACINGS * float(np.spacing(np.float32(max(abs(a), abs(b)))))
        if abs(a - b) <= allowance:
            allowed.append(where)
            return []
        return [f"{where}: {a!r} against {b!r} (difference {abs(a - b):.3g}, allowance {allowance:.3g})"]
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{where}: keys {sorted(set(a) ^ set(b))} on one line only"]
        return [d for k in sorted(a) for d in compare_values(a[k], b[k], f"{where}.{k}", allowed)]
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{where}: {len(a)} entries against {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in compare_values(x, y, f"{where}[{i}]", allowed)]
    return [f"{where}: {type(a).__name__} against {type(b).__name__}"]


def compare(first: Dict[str, dict], second: Dict[str, dict]) -> Tuple[List[str], List[str]]:
    """(report lines, failures) for two lines' results."""
    lines, failures = [], []
    if not first and not second:
        failures.append("no results on either line: nothing was compared")
    for name in sorted(set(first) | set(second)):
        if name not in first or name not in second:
            missing = "first" if name not in first else "second"
            failures.append(f"{name}: no result on the {missing} line (skipped, failed or not run there)")
            continue
        allowed: List[str] = []
        found = compare_values(first[name]["result"], second[name]["result"], name, allowed)
        failures += found
        status = "DIFFERS" if found else "same"
        extra = f", {len(allowed)} values within {SPACINGS} float32 spacings" if allowed else ""
        lines.append(f"{status:8s}{name}{extra}")
    return lines, failures


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description="Compare the results of the tests marked `lines` on two MindSpore lines; exit 1 on a difference."
    )
    parser.add_argument("first", type=Path, help="one line's MS_DEEPSEEK_LINE_RESULTS folder")
    parser.add_argument("second", type=Path, help="the other line's folder")
    args = parser.parse_args(argv)
    try:
        first, second = _load(args.first), _load(args.second)
    except SystemExit as e:
        print(e, file=sys.stderr)
        return 2
    versions = [sorted({r["mindspore"] for r in side.values()}) for side in (first, second)]
    print(f"MindSpore {', '.join(versions[0]) or '?'} against {', '.join(versions[1]) or '?'}:")
    lines, failures = compare(first, second)
    print("\n".join(lines))
    for f in failures:
        print(f"DIFFERENCE {f}", file=sys.stderr)
    print(f"{len(lines)} results compared, {len(failures)} differences")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
