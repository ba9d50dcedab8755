"""The two tiers (tests/helpers/tiers.py): the default tier holds no test marked slow and exactly the two smoke
tests; a test that starts a compile or an msrun job without a slow, heavy or smoke mark fails, wherever it runs."""

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

import tiers
from repo_paths import REPO

SMOKE = {
    "tests/compile/test_compile_recipes.py::test_a_small_sharded_layout_compiles_and_matches_the_plan",
    "tests/compile/test_execute_recipes.py::test_recipe_executes_like_one_device[v2-lite-sft-8npu]",
}


def _collect():
    """nodeid -> its tier marks, for every test (no mark selection)."""
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", "", "tests"],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=dict(os.environ, **{tiers.LIST_ENV: "1"}),
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    rows = [line.split(" ") for line in run.stdout.splitlines() if line.startswith("TIER ")]
    return {row[1]: set(filter(None, row[2].split(","))) for row in rows}


def test_the_default_tier_holds_no_slow_test_and_the_two_smoke_tests():
    marks = _collect()
    default = {t for t, m in marks.items() if not m & {"slow", "heavy"}}
    slow = {t for t, m in marks.items() if "slow" in m}
    assert {t for t, m in marks.items() if "smoke" in m} == SMOKE
    assert SMOKE <= default
    full_tier_folders = tuple(f"tests/{f}/" for f in tiers.FULL_TIER_FOLDERS)
    assert {t for t in default if t.startswith(full_tier_folders)} == SMOKE
    assert len(default) > 1000 and len(slow) > 50, (len(default), len(slow))


@pytest.mark.parametrize(
    "argv, env, what",
    [
        (["python", "-m", "ms_deepseek.verification.compile.worker", "r.json"], None, "a MindSpore compile"),
        (["python", "-m", "ms_deepseek.verification.execute.one_device", "r.json"], None, "a MindSpore compile"),
        (["/venv/bin/msrun", "--worker_num=2", "train.py"], None, "an msrun job"),
        (["python", "-m", "ms_deepseek.cli", "plan", "--recipe", "r.yaml", "--compile"], None, "plan --compile"),
        (["python", "-m", "ms_deepseek.cli", "plan", "--recipe", "r.yaml", "--execute"], None, "plan --compile"),
        (["python", "x.py"], {"MS_SIMULATION_LEVEL": "0"}, "a MindSpore dry-run compile"),
        (["python", "-m", "ms_deepseek.cli", "plan", "--recipe", "r.yaml"], None, None),
        (["python", "-m", "ms_deepseek.cli", "launch", "r.yaml", "--dry-run"], None, None),
        (["python", "-m", "ms_deepseek.cli", "launch", "--help"], None, None),
        (["python", "-m", "ms_deepseek.cli", "train", "r.yaml"], {"MS_DEEPSEEK_DEVICE": "CPU"}, None),
        ("g++ --version", None, None),
        (["bash", "-c", "cd /tmp && ms-deepseek plan --recipe r.yaml --compile --ranks 0"], None, "plan --compile"),
    ],
)
def test_what_counts_as_a_compile_or_an_msrun_job(argv, env, what):
    found = tiers.launches_heavy_work(argv, env)
    assert (found is None) if what is None else (found or "").startswith(what), found


PLANTED = """
import subprocess
import sys

import pytest

COMPILE = [sys.executable, "-c", "pass", "ms_deepseek.verification.compile.worker"]


def test_unmarked_compile():
    subprocess.run(COMPILE, check=True)


@pytest.mark.slow
def test_slow_compile():
    subprocess.run(COMPILE, check=True)


def test_no_compile():
    subprocess.run([sys.executable, "-c", "pass"], check=True)
"""


def test_a_test_that_compiles_without_a_slow_mark_fails(tmp_path):
    """The guard in tests/conftest.py, on a copy of the suite's configuration with planted tests: the unmarked test
    that starts a compile worker fails naming what it started; the same test under tests/compile/ (slow by its
    folder) and the one marked slow pass."""
    (tmp_path / "tests" / "helpers").mkdir(parents=True)
    (tmp_path / "tests" / "compile").mkdir()
    shutil.copy(REPO / "pytest.ini", tmp_path / "pytest.ini")
    shutil.copy(REPO / "tests" / "conftest.py", tmp_path / "tests" / "conftest.py")
    for helper in ("tiers.py", "repo_paths.py"):
        shutil.copy(REPO / "tests" / "helpers" / helper, tmp_path / "tests" / "helpers" / helper)
    (tmp_path / "tests" / "test_planted_tier.py").write_text(textwrap.dedent(PLANTED))
    (tmp_path / "tests" / "compile" / "test_planted_folder.py").write_text(
        "import subprocess, sys\n\n\ndef test_folder_compile():\n"
        "    subprocess.run([sys.executable, '-c', 'pass', 'ms_deepseek.verification.compile.worker'], check=True)\n"
    )
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not heavy", "tests"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    out = run.stdout
    assert run.returncode == 1, out[-3000:]
    assert "4 passed, 1 error" in out, out[-3000:]  # the unmarked test's call passes, its teardown fails
    assert "test_planted_tier.py::test_unmarked_compile started a MindSpore compile" in out, out[-3000:]
