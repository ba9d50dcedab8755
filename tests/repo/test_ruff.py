"""The linter and the formatter pass on the repository (config: pyproject.toml).

tools/test.sh (the README's test command) installs ruff with the test extra and runs both before pytest;
this test runs them too when ruff is installed."""

import subprocess
import sys

import pytest

from repo_paths import REPO

pytest.importorskip("ruff", reason="ruff is in requirements-test.txt: pip install -e '.[test]'")


@pytest.mark.parametrize("command", [["check", "."], ["format", "--check", "."]], ids=["check", "format"])
def test_ruff_passes(command):
    proc = subprocess.run([sys.executable, "-m", "ruff", *command], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
