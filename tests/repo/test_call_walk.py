"""tools/call_walk.py: the walk of a command through the rooms, and the calls that go back up a layer."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from types import SimpleNamespace

from repo_paths import REPO

PKG = str(REPO / "ms_deepseek")


def _tool():
    spec = importlib.util.spec_from_file_location("call_walk", REPO / "tools" / "call_walk.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _frame(path, name, back=None):
    return SimpleNamespace(f_code=SimpleNamespace(co_filename=path, co_name=name), f_back=back)


def test_a_planted_callback_up_a_layer_is_reported_and_a_constructor_is_apart():
    tool = _tool()
    walk = tool.Walk(tool._layers())
    cli = _frame(f"{PKG}/cli/plan.py", "run")
    core = _frame(f"{PKG}/core/schema.py", "from_dict", back=_frame("/usr/lib/python3/dataclasses.py", "x", cli))
    walk.profile(core, "call", None)
    # generic code below builds a higher room's dataclass: a constructor, counted apart
    walk.profile(
        _frame(f"{PKG}/config/recipe.py", "__post_init__", back=_frame("<string>", "__init__", core)), "call", None
    )
    # a function of a higher room called back from below, through a library frame
    walk.profile(
        _frame(f"{PKG}/train/trainer.py", "on_step", back=_frame("/lib/tqdm.py", "update", core)), "call", None
    )
    # a progress lambda handed down is a call up, not a constructor
    walk.profile(_frame(f"{PKG}/cli/plan.py", "<lambda>", back=core), "call", None)
    assert walk.order == ["core", "config", "train", "cli"]
    assert dict(walk.upward) == {
        ("core/schema.py:from_dict", "train/trainer.py:on_step"): 1,
        ("core/schema.py:from_dict", "cli/plan.py:<lambda>"): 1,
    }
    assert dict(walk.built_up) == {("core/schema.py:from_dict", "config/recipe.py:__post_init__"): 1}
    assert walk.entries == {"core": 1, "config": 1, "train": 1, "cli": 1}


def test_the_plan_command_walks_down_only():
    res = subprocess.run(
        [
            sys.executable,
            "tools/call_walk.py",
            "--no-upward",
            "--",
            "plan",
            "--recipe",
            "recipes/v2-lite-sft-8npu.yaml",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "rooms, in the order entered: cli -> " in res.stdout and "parallel_plan" in res.stdout, res.stdout
    assert "calls up a layer: 0 (0 distinct)" in res.stdout, res.stdout
