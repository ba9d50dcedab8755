"""Shared by the bad-input tests (tests/cli/test_*_bad_input.py and the unit rooms): run the real CLI in-process and look at what it left."""

import json
import shutil
from pathlib import Path

from ms_deepseek.cli import main

from repo_paths import FIXTURES

LITE = FIXTURES / "lite"


def run_cli(capsys, argv):
    """(exit code, stdout, stderr) of ``ms-deepseek ARGV``; argparse's own refusals included (SystemExit).
    Any other exception propagates: a traceback fails the test."""
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


def assert_refused(code, err, *names):
    """Exit 2, one error line, naming every culprit."""
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert code == 2, err
    assert lines and lines[-1].startswith("ms-deepseek ") and "error:" in lines[-1], err
    for name in names:
        assert name in lines[-1], (name, err)


def listing(folder: Path) -> set:
    return {str(p.relative_to(folder)) for p in Path(folder).rglob("*")}


def hf_copy(folder: Path, name: str = "hf") -> Path:
    dst = Path(folder) / name
    shutil.copytree(LITE, dst)
    return dst


def edit_config(hf: Path, **changes) -> Path:
    cfg = json.loads((hf / "config.json").read_text())
    cfg.update(changes)
    (hf / "config.json").write_text(json.dumps(cfg))
    return hf


DEEP = 100_000


def deep() -> str:
    """JSON nested DEEP levels: past every recursion limit."""
    return "[" * DEEP + "]" * DEEP
