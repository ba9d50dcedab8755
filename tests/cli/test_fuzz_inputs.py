"""Mutated inputs end in one error line or are accepted; never a traceback or a hang.

First the inputs fuzz runs found mishandled, one test each, then the seeded fuzzer of
:mod:`fuzz_helpers` over config.json, safetensors headers, the shard index, layout.json,
recipes and metrics.jsonl, through the CLI's ``main`` in this process.
"""

import json
import shutil
import signal
import struct
import time

import pytest

from bad_input_helpers import assert_refused, run_cli
from fuzz_helpers import FORMATS, build_fixtures, run_case

CASES_PER_FORMAT = 300  # 9 formats: 2,700 cases (the fuzz test prints the time each format took)


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory):
    return build_fixtures(tmp_path_factory.mktemp("fuzz") / "fx")


@pytest.fixture
def hang_guard():
    """A hang fails the test instead of stalling the suite."""

    def alarm(signum, frame):
        raise AssertionError("still running after 20 s: a hang")

    old = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(20)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def _copy(fixtures, key, tmp_path):
    dst = tmp_path / key
    shutil.copytree(fixtures[key], dst)
    return dst


def _hf_to_ms(case, tmp_path, *extra):
    return ["convert", "hf-to-ms", case, tmp_path / "out", "--no-progress", "--workers", "1", *extra]


# ------------------------------------------------------------------------- what fuzz runs found
def test_shard_name_too_long_for_the_file_system(capsys, tmp_path, fixtures):
    case = _copy(fixtures, "hf_index", tmp_path)
    index = json.loads((case / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = "x" * 300 + ".safetensors"
    (case / "model.safetensors.index.json").write_text(json.dumps(index))
    code, _, err = run_cli(capsys, _hf_to_ms(case, tmp_path))
    assert_refused(code, err, "model.safetensors.index.json", "weight_map['model.norm.weight']", "File name too long")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("where", ["parallel.dp", "world_size", "shape"])
def test_infinity_in_layout_json(capsys, tmp_path, fixtures, where):
    case = _copy(fixtures, "sharded", tmp_path)
    layout = json.loads((case / "layout.json").read_text())
    if where == "parallel.dp":
        layout["parallel"]["dp"] = float("inf")
    elif where == "world_size":
        layout["world_size"] = float("inf")
    else:
        layout["tensors"]["lm_head.weight"]["shape"][0] = float("inf")
    (case / "layout.json").write_text(json.dumps(layout))  # writes the token Infinity
    code, _, err = run_cli(capsys, ["convert", "ms-to-hf", case, tmp_path / "out", "--no-progress"])
    assert_refused(code, err, "layout.json", "infinity")


@pytest.mark.parametrize("value", [["F32"], {"F32": 1}])
def test_object_where_the_safetensors_header_wants_a_dtype_string(capsys, tmp_path, fixtures, value):
    case = _copy(fixtures, "hf_single", tmp_path)
    raw = (case / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    header["lm_head.weight"]["dtype"] = value
    body = json.dumps(header).encode()
    (case / "model.safetensors").write_bytes(struct.pack("<Q", len(body)) + body + raw[8 + n :])
    code, _, err = run_cli(capsys, _hf_to_ms(case, tmp_path))
    assert_refused(code, err, "model.safetensors", "lm_head.weight", "dtype")


def test_report_on_huge_steps_negative_grad_norm_and_no_loss(capsys, tmp_path, hang_guard):
    """Five records, one grad_norm negative, none with a loss, steps near 2**62: the x-axis ticks
    were stepped by t += 2 at 4.6e18, where the addition changes nothing (an endless loop)."""
    rows = [{"step": 2**62 + i, "grad_norm": -1.0 if i == 2 else 1.0} for i in range(5)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, out, err = run_cli(capsys, ["report", tmp_path, "--out", tmp_path / "r.html"])
    assert code == 0, err
    assert "5 records" in out and (tmp_path / "r.html").is_file()


@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan"])
def test_non_finite_capacity_factor_in_a_recipe(capsys, tmp_path, fixtures, value):
    case = _copy(fixtures, "recipe", tmp_path)
    text = (case / "r.yaml").read_text()
    (case / "r.yaml").write_text(text.replace("capacity_factor: 2.0", f"capacity_factor: {value}"))
    code, _, err = run_cli(capsys, ["plan", "--recipe", case / "r.yaml"])
    assert_refused(code, err, "r.yaml", "model.overrides.capacity_factor", "finite")


@pytest.mark.parametrize(
    "key,value", [("num_hidden_layers", 10**30), ("num_hidden_layers", 10**7), ("n_routed_experts", 10**9)]
)
def test_config_far_bigger_than_its_tensors(capsys, tmp_path, fixtures, hang_guard, key, value):
    """A config that declares far more layers or experts than its tensors hold is refused from the tensor names,
    without first listing every expected tensor."""
    for folder, extra in (("hf_single", ()), ("hf_index", ("--dp", "2", "--tp", "2"))):
        case = _copy(fixtures, folder, tmp_path)
        cfg = json.loads((case / "config.json").read_text())
        cfg[key] = value
        (case / "config.json").write_text(json.dumps(cfg))
        t0 = time.monotonic()
        code, _, err = run_cli(capsys, _hf_to_ms(case, tmp_path, *extra))
        print(f"{folder} {key}={value}: refused in {time.monotonic() - t0:.2f} s")
        assert_refused(code, err, "config.json", key, "does not match the tensors")


def test_plan_of_a_recipe_with_a_billion_layers(capsys, tmp_path, fixtures, hang_guard):
    """The planner walks each layer, so 10**9 layers would never end: more than MAX_LAYERS is refused."""
    case = _copy(fixtures, "recipe", tmp_path)
    code, _, err = run_cli(
        capsys, ["plan", "--recipe", case / "r.yaml", "--set", "model.overrides.num_hidden_layers=1000000000"]
    )
    assert_refused(code, err, "num_hidden_layers", "1024")


def test_sharded_checkpoint_config_far_bigger_than_its_layout(capsys, tmp_path, fixtures, hang_guard):
    case = _copy(fixtures, "sharded", tmp_path)
    cfg = json.loads((case / "config.json").read_text())
    cfg["num_hidden_layers"] = 10**8
    (case / "config.json").write_text(json.dumps(cfg))
    code, _, err = run_cli(capsys, ["convert", "ms-to-hf", case, tmp_path / "out", "--no-progress"])
    assert_refused(code, err, "config.json", "num_hidden_layers", "layout.json", "does not match")


def _convert_bounded(case, out, seconds=60):
    """``convert ms-to-hf CASE OUT`` in a child process with 4 GB of address space and a time limit: what ate
    the machine dies of MemoryError (a traceback) or runs out of time there, not in the test process."""
    import os
    import resource
    import subprocess
    import sys

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))

    from repo_paths import REPO

    path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])  # this checkout's package
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", PYTHONPATH=path)
    argv = [sys.executable, "-m", "ms_deepseek.cli", "convert", "ms-to-hf", str(case), str(out), "--no-progress"]
    try:
        return subprocess.run(argv, capture_output=True, text=True, env=env, preexec_fn=limit, timeout=seconds)
    except subprocess.TimeoutExpired:
        raise AssertionError(
            f"still running after {seconds} s: a declared size drove a loop or an allocation"
        ) from None


def test_huge_declared_expert_shape_in_layout_json(tmp_path, fixtures):
    """Fuzz case 8457: one expert tensor declared [2147483648, ...] in layout.json is refused in one line
    naming layout.json, the tensor and the size, within a bounded time and memory, and no output is made (a
    placement check that enumerated ``range(shape[0])`` would exhaust the machine or, under an address-space
    limit, end in a MemoryError traceback)."""
    case = _copy(fixtures, "sharded_ep", tmp_path)
    layout = json.loads((case / "layout.json").read_text())
    name = next(n for n, t in layout["tensors"].items() if t.get("experts"))
    layout["tensors"][name]["shape"][0] = 2147483648
    (case / "layout.json").write_text(json.dumps(layout))
    proc = _convert_bounded(case, tmp_path / "out")
    assert_refused(proc.returncode, proc.stderr, "layout.json", name, "2147483648")
    assert not (tmp_path / "out").exists()


def test_huge_declared_world_size_in_layout_json(tmp_path, fixtures):
    """dp 2**31 in layout.json (every tensor's dev_matrix to match): the reader is bounded by the rank
    folders present, not by looping over the 2**32 declared ranks to list the missing ones."""
    case = _copy(fixtures, "sharded", tmp_path)
    layout = json.loads((case / "layout.json").read_text())
    dp, tp = 2**31, layout["parallel"]["tp"]
    layout["parallel"]["dp"], layout["world_size"] = dp, dp * tp * layout["parallel"]["pp"]
    for t in layout["tensors"].values():
        t["dev_matrix"], t["tensor_map"] = [dp * tp], [-1] * len(t["shape"])
    (case / "layout.json").write_text(json.dumps(layout))
    proc = _convert_bounded(case, tmp_path / "out")
    assert_refused(proc.returncode, proc.stderr, "rank_00004", "missing rank folder", "layout.json")


# ---------------------------------------------------------------------------- the fuzzer
@pytest.mark.slow
def test_mutated_inputs_are_accepted_or_refused_in_one_line(fixtures, tmp_path, capsys):
    work = tmp_path / "cases"
    work.mkdir()
    failures, lines = [], []
    t_all = time.monotonic()
    for fmt in FORMATS:
        t0, accepted = time.monotonic(), 0
        for seed in range(CASES_PER_FORMAT):
            outcome = run_case(fixtures, work, fmt, seed, time_limit=10.0)
            accepted += outcome.why.endswith("] accepted")
            if not outcome.ok:
                failures.append(outcome.why)
        lines.append(f"{fmt.name}: {CASES_PER_FORMAT} cases, {accepted} accepted, {time.monotonic() - t0:.1f} s")
    with capsys.disabled():
        print("\n" + "\n".join(lines) + f"\nfuzz total {time.monotonic() - t_all:.1f} s")
    assert not failures, f"{len(failures)} finding(s); the first:\n" + "\n\n".join(failures[:3])


def test_capacity_factor_near_float_max(capsys, tmp_path, fixtures):
    """capacity_factor 1e308 is finite, but factor x tokens overflowed to inf inside ceil(): OverflowError."""
    case = _copy(fixtures, "recipe", tmp_path)
    code, _, err = run_cli(
        capsys, ["plan", "--recipe", case / "r.yaml", "--set", "model.overrides.capacity_factor=1e308"]
    )
    assert code == 0, err


def test_recipe_model_source_too_long_for_the_file_system(capsys, tmp_path, fixtures):
    case = _copy(fixtures, "recipe", tmp_path)
    text = (case / "r.yaml").read_text()
    (case / "r.yaml").write_text(text.replace("source: tiny", "source: " + "x" * 300))
    code, _, err = run_cli(capsys, ["plan", "--recipe", case / "r.yaml"])
    assert_refused(code, err, "xxxxxxxx", "file name too long")
