"""tools/pynative_parallel_step.py: the dynamic-graph (PyNative) parallel step against one device.

* The comparison itself (``compare``) on made-up steps: equal steps agree; a halved weight change, a
  changed loss and a NaN each differ. Runs on every MindSpore line (numpy only).
* On MindSpore 2.10 (the first line with the dynamic-graph parallel stack; skipped on 2.9 with that reason):
  which collectives run in PyNative on CPU, the facts docs/dynamic-graph-parallel.md builds on
  (``--probe-collectives``, two msrun workers); when MindSpore gives its comm_func collectives CPU kernels,
  this fails and the note's "where it stops" needs rewriting.
* With ``HYPER_PARALLEL_PATH`` naming a HyperParallel source checkout (not on the package index, so skipped
  without it): the tiny model's two steps over two msrun workers agree with one device, and a planted
  half gradient on one rank is caught.
"""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from builders import free_port
from repo_paths import REPO

TOOL = REPO / "tools" / "pynative_parallel_step.py"


def tool():
    spec = importlib.util.spec_from_file_location("pynative_parallel_step", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def mindspore_line() -> str:
    import mindspore

    from ms_deepseek.core.runtime import mindspore_line as line

    return line(mindspore.__version__)


needs_210 = pytest.mark.skipif(
    mindspore_line() != "2.10",
    reason="MindSpore's dynamic-graph parallel stack (HyperParallel) starts with the 2.10 line",
)


def made_up_steps(rng, change_scale=1.0):
    init = {"w": rng.standard_normal((4, 6)).astype(np.float32), "n": np.ones(6, np.float32)}
    steps, prev = [], init
    for _ in range(2):
        grads = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in init.items()}
        weights = {k: prev[k] - np.float32(0.05 * change_scale) * grads[k] for k in init}
        steps.append({"loss": 8.0, "gnorm": 3.0, "grads": grads, "weights": weights, "seconds": 0.0})
        prev = weights
    return init, steps


def test_compare_agrees_on_equal_steps_and_catches_each_plant():
    t = tool()
    init, steps = made_up_steps(np.random.default_rng(0))
    single = {"init": init, "steps": steps}
    rows, ok = t.compare(single, {"steps": steps})
    assert ok and len(rows) == 8

    _, half = made_up_steps(np.random.default_rng(0), change_scale=0.5)  # the same gradients, half the update
    rows, ok = t.compare(single, {"steps": half})
    assert not ok
    assert [r[1].split(" (")[0] for r in rows if r[2] > r[3]] == ["weight changes", "weight changes"]

    moved = [dict(s) for s in steps]
    moved[1] = dict(moved[1], loss=8.0 * (1 + 1e-4))
    rows, ok = t.compare(single, {"steps": moved})
    assert not ok and [(r[0], r[1]) for r in rows if r[2] > r[3]] == [(2, "loss")]

    nan = [dict(s) for s in steps]
    nan[0] = dict(nan[0], gnorm=float("nan"))
    assert not t.compare(single, {"steps": nan})[1]

    assert not t.compare(single, {"steps": steps[:1]})[1]  # a step missing on the sharded side


def run_tool(*args, timeout=900):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    cmd = [sys.executable, str(TOOL), "--master-port", str(free_port()), *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.msrun
@pytest.mark.lines  # tools/test.sh --full runs it on the 2.10 line
@needs_210
def test_which_collectives_run_in_pynative_on_cpu():
    proc = run_tool("--probe-collectives", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    verdicts = dict(line.split(": ", 1) for line in proc.stdout.splitlines() if ": " in line)
    runs = {name for name, verdict in verdicts.items() if verdict.startswith("runs")}
    # HyperParallel's MindSpore platform calls comm_func: no CPU kernel for any of them
    assert runs == {"ops.AllGather", "ops.AllReduce", "mint.distributed.all_reduce", "grad of ops.AllReduce"}, (
        proc.stdout
    )
    assert all("as expected" in verdicts[name] for name in runs), proc.stdout  # and compute the right values
    assert "InnerCommAllGather unregistered" in verdicts["comm_func.all_gather_into_tensor"]
    # an AllGather differentiates into a ReduceScatter, which has no CPU kernel
    assert "Unsupported op [ReduceScatter] on CPU" in verdicts["grad of ops.AllGather"]


HYPER_PARALLEL = os.environ.get("HYPER_PARALLEL_PATH")
needs_hyper_parallel = pytest.mark.skipif(
    not HYPER_PARALLEL or not (Path(HYPER_PARALLEL) / "hyper_parallel" / "__init__.py").is_file(),
    reason="HYPER_PARALLEL_PATH does not name a HyperParallel source checkout (it is not on the package index)",
)


@pytest.mark.msrun
@needs_hyper_parallel
@needs_210  # the closest skip mark is read first: on 2.9 the reason is the line
@pytest.mark.parametrize("plant", ["none", "half-grad"])
def test_the_sharded_step_equals_one_device(plant):
    proc = run_tool("--hyper-parallel", HYPER_PARALLEL, "--plant", plant)
    last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-3000:]
    if plant == "none":
        assert proc.returncode == 0 and last == "agrees with one device", proc.stdout + proc.stderr[-3000:]
    else:
        assert proc.returncode == 1 and last == "DIFFERS from one device", proc.stdout + proc.stderr[-3000:]
