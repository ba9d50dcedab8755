"""What a user does first, run the way a user runs it, on each supported MindSpore line (tests/helpers/lines.py).

The tiny default recipe trains, and a HuggingFace checkpoint converts to the ms_deepseek layout and back byte for
byte, through the ``ms-deepseek`` command. Both are marked ``lines``: ``bash tools/test.sh --full`` runs them on
2.9 in the full tier and again on 2.10, and ``tools/compare_lines.py`` fails on any difference between the two
lines' losses, gradient norms and tensor digests.
"""

import hashlib
import json
import subprocess
import sys

import pytest
import safetensors

from lines import record
from repo_paths import FIXTURES, RECIPES

pytestmark = pytest.mark.lines
STEPS = 8


def _cli(*args, cwd):
    run = subprocess.run([sys.executable, "-m", "ms_deepseek.cli", *map(str, args)], capture_output=True, cwd=cwd)
    assert run.returncode == 0, run.stderr.decode()[-3000:]
    return run


def test_the_tiny_default_trains(tmp_path):
    sets = [f"train.steps={STEPS}", "logging.log_interval=1"]
    _cli(
        "train",
        RECIPES / "tiny-cpu.yaml",
        "--output",
        tmp_path / "run",
        *[a for s in sets for a in ("--set", s)],
        cwd=tmp_path,
    )
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r.get("kind", "train") == "train" and "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1)), rows[:3]
    losses = [r["loss"] for r in steps]
    assert losses[-1] < losses[0], losses  # it learns
    record("train tiny-cpu", {"loss": losses, "grad_norm": [r.get("grad_norm") for r in steps]})


def _digests(folder):
    """tensor name -> (dtype, shape, sha256 of the bytes) over the checkpoint files of ``folder``."""
    out = {}
    for path in sorted(folder.glob("model*.safetensors")):
        for name, t in safetensors.deserialize(path.read_bytes()):
            out[name] = [t["dtype"], list(t["shape"]), hashlib.sha256(t["data"]).hexdigest()]
    return out


def test_a_checkpoint_converts_to_mindspore_and_back_byte_exact(tmp_path):
    src = FIXTURES / "lite"
    _cli("convert", "hf-to-ms", src, tmp_path / "ms", cwd=tmp_path)
    _cli("convert", "ms-to-hf", tmp_path / "ms", tmp_path / "hf", cwd=tmp_path)
    original, back = _digests(src), _digests(tmp_path / "hf")
    assert original and back == original
    record("convert lite round trip", {"ms_layout": _digests(tmp_path / "ms"), "back": back})
