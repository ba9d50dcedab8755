"""ops/build_ascend.sh against a stub CANN tree that behaves like CANN 8.x's.

No CANN here, so the stub reproduces what broke the script on real hosts (design.md
section 7): ``bin/setenv.bash`` reads ``$1`` and ``$LD_LIBRARY_PATH`` unguarded (sourcing
it under ``set -u`` kills the caller), and the package installer prompts with ``read``
when the vendor folder exists unless ``--quiet``. The stub's project template has a
``build.sh`` (the "compiler") that checks the staged sources and the CANN environment
and writes a ``.run`` installer; every call is recorded in a log the tests read.
The build script runs with stdin held open (as in a terminal), so a prompt shows up as
a timeout, not as a silent EOF.
"""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "ops" / "build_ascend.sh"

SETENV = r'''# stub of CANN 8.x bin/setenv.bash: $1 and $LD_LIBRARY_PATH are read without defaults
if [ "$1" = "--force" ]; then :; fi
export LD_LIBRARY_PATH=@CANN@/lib64:$LD_LIBRARY_PATH
export ASCEND_HOME_PATH=@CANN@
export ASCEND_OPP_PATH=@CANN@/opp
echo "setenv" >> "$STUB_LOG"
@EXTRA@
'''

BUILD_SH = r'''#!/bin/bash
# stub compiler: needs the CANN environment and our sources, writes the .run installer
set -e
echo "build.sh ASCEND_HOME_PATH=${ASCEND_HOME_PATH:-unset} CUSTOM_OPP=${ASCEND_CUSTOM_OPP_PATH:-unset}" >> "$STUB_LOG"
[ -n "${ASCEND_HOME_PATH:-}" ] || { echo "error: CANN environment not set"; exit 1; }
ls op_host > "$STUB_DIR/op_host.txt"
ls op_kernel > "$STUB_DIR/op_kernel.txt"
cp CMakePresets.json "$STUB_DIR/presets.json"
@FAIL@
mkdir -p build_out
cat > build_out/custom_opp_ubuntu_x86_64.run <<'RUN'
#!/bin/bash
# stub of the generated installer: prompts before replacing an existing vendor folder
quiet=n; path="${ASCEND_OPP_PATH:-}"
for a in "$@"; do
  case "$a" in --quiet) quiet=y ;; --install-path=*) path="${a#*=}" ;; esac
done
echo "install $*" >> "$STUB_LOG"
vendor="$path/vendors/ms_deepseek"
if [ -d "$vendor" ] && [ "$quiet" != y ]; then
  echo "[ops_custom] $vendor exists. Do you want to replace it? [y/n]"
  read -r answer
  [ "$answer" = y ] || exit 1
fi
mkdir -p "$vendor/op_impl/ai_core/tbe" "$vendor/op_api/lib"
echo ms_deepseek > "$vendor/version.info"
RUN
'''

PRESETS = {"version": 1, "configurePresets": [{"name": "default", "cacheVariables": {
    "ASCEND_CANN_PACKAGE_PATH": {"type": "PATH", "value": "/usr/local/Ascend/latest"},
    "ASCEND_COMPUTE_UNIT": {"type": "STRING", "value": "ascend310b"},
    "vendor_name": {"type": "STRING", "value": "customize"}}}]}


def make_stub_cann(root: Path, setenv_extra: str = "", build_fail: str = "") -> Path:
    cann = root / "cann"
    (cann / "bin").mkdir(parents=True)
    (cann / "lib64").mkdir()
    (cann / "opp").mkdir()
    (cann / "bin" / "setenv.bash").write_text(SETENV.replace("@CANN@", str(cann)).replace("@EXTRA@", setenv_extra))
    sample = cann / "tools/msopgen/template/operator_demo_projects/ascendc_operator_sample"
    for sub in ("op_host", "op_kernel"):
        (sample / sub).mkdir(parents=True)
        (sample / sub / "add_custom.cpp").write_text("// template demo operator\n")
    (sample / "CMakePresets.json").write_text(json.dumps(PRESETS))
    (sample / "build.sh").write_text(BUILD_SH.replace("@FAIL@", build_fail))
    return cann


def run_build(tmp: Path, cann: Path, install: Path, script: Path = SCRIPT, timeout: float = 60):
    """Run the build script with stdin held open; returns (returncode, output). Timeout = hang."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("LD_LIBRARY_PATH", "ASCEND_HOME_PATH", "ASCEND_OPP_PATH", "ASCEND_CUSTOM_OPP_PATH")}
    env.update(STUB_LOG=str(tmp / "calls.log"), STUB_DIR=str(tmp), TMPDIR=str(tmp), PYTHON=sys.executable)
    out = open(tmp / "out.txt", "w+")
    proc = subprocess.Popen(["bash", str(script), "--cann", str(cann), "--install-path", str(install)],
                            stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT, env=env,
                            cwd=tmp, start_new_session=True)
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        rc = None
    finally:
        proc.stdin.close()
    out.seek(0)
    text = out.read()
    out.close()
    return rc, text


def calls(tmp: Path):
    path = tmp / "calls.log"
    return path.read_text().splitlines() if path.exists() else []


def test_build_and_reinstall_against_cann8_stub(tmp_path):
    cann = make_stub_cann(tmp_path)
    install = tmp_path / "opp"
    rc, out = run_build(tmp_path, cann, install)
    assert rc == 0, f"build script failed ({rc}):\n{out}\ncalls: {calls(tmp_path)}"
    log = calls(tmp_path)
    assert log[0] == "setenv"
    assert log[1] == f"build.sh ASCEND_HOME_PATH={cann} CUSTOM_OPP=unset"
    assert log[2].startswith("install ") and "--quiet" in log[2] and f"--install-path={install}" in log[2]
    assert (install / "vendors" / "ms_deepseek" / "version.info").is_file()
    host = set((tmp_path / "op_host.txt").read_text().split())
    kernel = set((tmp_path / "op_kernel.txt").read_text().split())
    for op in ("expert_lookup", "fp32_softmax", "repetition_penalty"):
        assert {f"{op}.cpp", f"{op}_tiling.h", f"{op}_tiling_logic.h"} <= host
        assert {f"{op}.cpp", f"{op}_tiling_logic.h"} <= kernel
    assert "msds_kernel_common.h" in host and "msds_ascendc_sync.h" in kernel
    assert "add_custom.cpp" not in host | kernel            # the template's demo operator is removed
    variables = json.loads((tmp_path / "presets.json").read_text())["configurePresets"][0]["cacheVariables"]
    assert variables["vendor_name"]["value"] == "ms_deepseek"
    assert variables["ASCEND_COMPUTE_UNIT"]["value"] == "ascend910b"
    assert variables["ASCEND_CANN_PACKAGE_PATH"]["value"] == str(cann)
    assert not list(tmp_path.glob("ms_deepseek_ascend_build.*"))  # staging folder removed

    # Second install into the existing vendor folder: the installer would prompt without --quiet.
    rc, out = run_build(tmp_path, cann, install)
    assert rc == 0, f"re-install failed or hung ({rc}):\n{out}"
    assert sum(line.startswith("install ") for line in calls(tmp_path)) == 2


def test_failing_setenv_is_reported(tmp_path):
    cann = make_stub_cann(tmp_path, setenv_extra="return 3")
    rc, out = run_build(tmp_path, cann, tmp_path / "opp")
    assert rc == 1
    assert f"build_ascend.sh: sourcing {cann}/bin/setenv.bash failed with status 3" in out
    assert calls(tmp_path) == ["setenv"]                    # nothing built after the failure


def test_failing_compile_is_reported_and_nothing_installed(tmp_path):
    cann = make_stub_cann(tmp_path, build_fail='echo "error: op_kernel/expert_lookup.cpp:67 boom"; exit 2')
    rc, out = run_build(tmp_path, cann, tmp_path / "opp")
    assert rc == 1
    assert "error: op_kernel/expert_lookup.cpp:67 boom" in out   # the compiler's own lines are shown
    assert "build_ascend.sh: build failed" in out
    assert not (tmp_path / "opp" / "vendors").exists()


@pytest.mark.parametrize("args, message", [
    (["--soc", "ascend999"], "--soc: unsupported SoC 'ascend999'"),
    (["--cann", "/nonexistent/cann"], "CANN not found at /nonexistent/cann"),
    (["--bogus"], "unknown argument --bogus"),
])
def test_bad_arguments(tmp_path, args, message):
    proc = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=30,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode != 0
    assert message in proc.stderr


# ----------------------------------------------------------------- tools/ascend_dryrun.sh
DRYRUN = REPO / "tools" / "ascend_dryrun.sh"


def dryrun(*args, env=None):
    full_env = {k: v for k, v in os.environ.items() if k not in ("ASCEND_HOME_PATH",)}
    full_env.update(env or {})
    return subprocess.run(["bash", str(DRYRUN), *args], capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL, env=full_env)


def test_dryrun_print_only_runs_one_rank_per_stage(tmp_path):
    proc = dryrun(str(REPO / "recipes" / "v2-sft-64npu.yaml"), "--print-only", "--out", str(tmp_path / "dr"))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("recipe ") and "dp1 tp8 pp8, world 64; dry run at 16 of 60 layers" in lines[0]
    assert lines[1].startswith("planner, full depth: ") and "tokens/s/NPU" in lines[1]
    assert lines[2].startswith("planner, 16 layers: GB per NPU by stage: ")
    assert len([float(x) for x in lines[2].rsplit(": ", 1)[1].split(", ")]) == 8
    ranks = [line for line in lines if line.startswith("stage ")]
    assert len(ranks) == 8
    for stage, line in enumerate(ranks):
        assert f"RANK_SIZE=64 RANK_ID={8 * stage} " in line and "MS_SIMULATION_LEVEL=1 " in line
        assert " train " in line and "--max-steps 1" in line and "num_hidden_layers=16" in line
        assert f"> {tmp_path}/dr/rank_{8 * stage}/dryrun.log" in line
    assert not (tmp_path / "dr").exists()                    # print-only writes nothing


def test_dryrun_print_only_passes_overrides_and_level(tmp_path):
    proc = dryrun(str(REPO / "recipes" / "v2-lite-sft-8npu.yaml"), "--print-only", "--level", "0", "--layers", "3",
                  "--set", "train.micro_batch_size=1")
    assert proc.returncode == 0, proc.stderr
    ranks = [line for line in proc.stdout.splitlines() if line.startswith("stage ")]
    assert len(ranks) == 1 and "MS_SIMULATION_LEVEL=0 RANK_SIZE=8 RANK_ID=0 " in ranks[0]
    assert "num_hidden_layers=3" in ranks[0] and "--set train.micro_batch_size=1" in ranks[0]


@pytest.mark.parametrize("args, message", [
    ([], "RECIPE: required"),
    (["recipes/none.yaml", "--print-only"], "RECIPE: no such file: recipes/none.yaml"),
    (["@recipe", "--level", "7"], "--level: must be 0, 1, 2 or 3, got '7'"),
    (["@recipe", "--layers", "0"], "--layers: must be a positive integer, got '0'"),
    (["@recipe", "--layers", "4", "--print-only"], "--layers: 4 is fewer than the 8 pipeline stages"),
    (["@recipe", "--layers", "99", "--print-only"], "--layers: 99 is more than the model's 60 layers"),
    (["@recipe", "--set", "oops"], "--set: expected SECTION.KEY=VALUE, got 'oops'"),
    (["@recipe", "--bogus"], "unknown option --bogus"),
    (["@recipe", "--set", "parallel.tp=3", "--print-only"], "the planner refused the recipe"),
    (["@recipe", "--cann", "/nonexistent/cann"], "CANN not found at /nonexistent/cann"),
])
def test_dryrun_bad_arguments(args, message):
    recipe = str(REPO / "recipes" / "v2-sft-64npu.yaml")
    proc = dryrun(*[recipe if a == "@recipe" else a for a in args])
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr


def test_dryrun_help():
    proc = dryrun("--help")
    assert proc.returncode == 0 and "MS_SIMULATION_LEVEL" in proc.stdout and "--print-only" in proc.stdout
