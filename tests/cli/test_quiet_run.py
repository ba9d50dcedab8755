"""A first run at default verbosity prints what matters and nothing alarming.

``ms-deepseek train`` (a tiny recipe, two steps, MindFormers' cosine schedule so its import
runs too) and ``ms-deepseek generate`` on the result, each in a fresh process with none of
the test session's log settings (no ``GLOG_v``): no line of their output may contain
``WARNING``, ``deprecated`` or ``Traceback``. MindFormers' import output lands in the run's
``logs/`` folder instead (``--verbose``: tests/cli/test_cli.py).
"""

import os
import subprocess
import sys

import pytest
import yaml

from builders import SMALL_MODEL as _SMALL_MODEL
from repo_paths import REPO

SMALL_MODEL = dict(_SMALL_MODEL, capacity_factor=2.0)  # this run's model keeps its capacity factor of 2.0

BAD = ("warning", "deprecat", "traceback")


def _env():
    env = {k: v for k, v in os.environ.items() if k not in ("GLOG_v", "MS_SUBMODULE_LOG_v", "MS_DEEPSEEK_VERBOSE")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _run(args, cwd):
    proc = subprocess.run(
        [sys.executable, "-m", "ms_deepseek.cli", *args],
        cwd=cwd,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    return proc.returncode, proc.stdout + proc.stderr


def _bad_lines(text):
    return [line for line in text.replace("\r", "\n").splitlines() if any(b in line.lower() for b in BAD)]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from ms_deepseek.data.prepare import prepare_embedded_default

    root = tmp_path_factory.mktemp("quiet")
    data = root / "corpus"
    prepare_embedded_default(data, seq_len=32, vocab_size=512, max_bytes=150_000, progress=False)
    recipe = {
        "model": {"source": "tiny", "overrides": dict(SMALL_MODEL)},
        "data": {"path": str(data), "num_workers": 1},
        "train": {"steps": 2, "micro_batch_size": 2, "seed": 3},
        "optim": {"lr": 3e-3, "warmup_steps": 1, "schedule": "cosine", "min_lr": 3e-4},
        "checkpoint": {"save_interval": 2, "keep_last": 1},
        "logging": {"log_interval": 1},
    }
    (root / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    code, out = _run(["train", "recipe.yaml", "--output", "run"], root)
    return root, code, out


def test_train_at_default_verbosity_prints_no_warning(run):
    root, code, out = run
    assert code == 0, out[-2000:]
    assert "final loss" in out
    assert _bad_lines(out) == [], out[-3000:]
    # a run no longer imports MindFormers (its cosine schedule branched: train/schedules.py), so it leaves no log
    assert not (root / "run" / "logs" / "mindformers-import.log").exists()


def test_generate_at_default_verbosity_prints_no_warning(run):
    root, code, _ = run
    assert code == 0
    code, out = _run(["generate", "run", "--prompt-ids", "5,6,7", "--max-new-tokens", "3"], root)
    assert code == 0, out[-2000:]
    assert _bad_lines(out) == [], out[-3000:]
