"""ops/build_ascend.sh against stub CANN trees with the real trees' shape (tests/helpers/cann_stub.py).

No CANN here, so the stubs reproduce what broke the script on real hosts (design.md section 7):
the env script reads ``$1`` and ``$LD_LIBRARY_PATH`` unguarded (sourcing it under ``set -u``
kills the caller) and ends on a probe that returns non-zero; CANN 9.0.0's template holds its
cmake helpers as relative symlinks into ``common/util`` (a plain ``cp -r`` leaves them dangling
and the template's ``build.sh`` produces no package); the package installer prompts with
``read`` when the vendor folder exists unless ``--quiet``. The stub "compiler" writes what
MindSpore's custom-op loader reads, so build -> install -> ``installed_op_types()`` ->
MindSpore's own registration info (``CustomInfoGenerator``) runs end to end here.
The build script runs with stdin held open (as in a terminal), so a prompt shows up as a
timeout, not as a silent EOF.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from cann_stub import LAYOUTS, FakeAscendContext, make_stub_cann
from repo_paths import REPO

SCRIPT = REPO / "ops" / "build_ascend.sh"
OP_TYPES = {"ExpertLookup", "Fp32Softmax", "RepetitionPenalty"}


def run_build(tmp: Path, cann: Path, install: Path, script: Path = SCRIPT, timeout: float = 60, extra_env=None):
    """Run the build script with stdin held open; returns (returncode, output). Timeout = hang."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASCEND_") and k != "LD_LIBRARY_PATH"}
    env.update(STUB_LOG=str(tmp / "calls.log"), STUB_DIR=str(tmp), TMPDIR=str(tmp), PYTHON=sys.executable)
    env.update(extra_env or {})
    out = open(tmp / "out.txt", "w+")
    proc = subprocess.Popen(
        ["bash", str(script), "--cann", str(cann), "--install-path", str(install)],
        stdin=subprocess.PIPE,
        stdout=out,
        stderr=subprocess.STDOUT,
        env=env,
        cwd=tmp,
        start_new_session=True,
    )
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


def installed_vendor(install: Path) -> Path:
    return install / "vendors" / "ms_deepseek"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_build_and_reinstall(tmp_path, layout):
    cann = make_stub_cann(tmp_path, layout)
    install = tmp_path / "opp"
    rc, out = run_build(tmp_path, cann, install)
    assert rc == 0, f"build script failed ({rc}):\n{out}\ncalls: {calls(tmp_path)}"
    log = calls(tmp_path)
    assert log[0] == "setenv"
    assert log[1] == f"build.sh ASCEND_HOME_PATH={cann} CUSTOM_OPP=unset"
    assert log[2] == "compiled ExpertLookup,Fp32Softmax,RepetitionPenalty for ascend910b"
    assert log[3].startswith("install ") and "--quiet" in log[3] and f"--install-path={install}" in log[3]
    # the env script's last probe returned 1: noted, not fatal
    assert "returned 1 (one of its own probes)" in out
    vendor = installed_vendor(install)
    assert (vendor / "version.info").read_text() == "ms_deepseek\n"
    info = json.loads((vendor / "op_impl/ai_core/tbe/config/ascend910b/aic-ascend910b-ops-info.json").read_text())
    assert set(info) == OP_TYPES
    # each OpDef names its kernel file (opFile.value): op_kernel/<op>.cpp
    assert {t: info[t]["opFile"]["value"] for t in OP_TYPES} == {
        "ExpertLookup": "expert_lookup",
        "Fp32Softmax": "fp32_softmax",
        "RepetitionPenalty": "repetition_penalty",
    }
    # ... and its kernel entry (opInterface.value), the extern "C" function of that file
    assert {t: info[t]["opInterface"]["value"] for t in OP_TYPES} == {t: info[t]["opFile"]["value"] for t in OP_TYPES}
    # the compile check's ops-info (ms_deepseek.ops.opdef, read from the same sources) is the installed one
    from ms_deepseek.ops import opdef

    assert opdef.all_op_info(REPO / "ops") == info
    assert (vendor / "op_api/include/aclnn_repetition_penalty.h").is_file()
    host = set((tmp_path / "op_host.txt").read_text().split())
    kernel = set((tmp_path / "op_kernel.txt").read_text().split())
    for op in ("expert_lookup", "fp32_softmax", "repetition_penalty"):
        assert {f"{op}.cpp", f"{op}_tiling.h", f"{op}_tiling_logic.h"} <= host
        assert {f"{op}.cpp", f"{op}_tiling_logic.h"} <= kernel
    assert "msds_kernel_common.h" in host and "msds_ascendc_sync.h" in kernel
    assert "add_custom.cpp" not in host | kernel  # the template's demo operator is removed
    variables = json.loads((tmp_path / "presets.json").read_text())["configurePresets"][0]["cacheVariables"]
    assert variables["vendor_name"]["value"] == "ms_deepseek"
    assert variables["ASCEND_COMPUTE_UNIT"]["value"] == "ascend910b"
    assert variables["ASCEND_CANN_PACKAGE_PATH"]["value"] == str(cann)
    assert not list(tmp_path.glob("ms_deepseek_ascend_build.*"))  # staging folder removed

    # Second install into the existing vendor folder: the installer would prompt without --quiet.
    rc, out = run_build(tmp_path, cann, install)
    assert rc == 0, f"re-install failed or hung ({rc}):\n{out}"
    assert sum(line.startswith("install ") for line in calls(tmp_path)) == 2


def test_cann9_template_links_are_staged_as_files(tmp_path):
    cann = make_stub_cann(tmp_path, "cann9")
    link = cann / "tools/op_project_templates/ascendc/customize/cmake/util/preset_parse.py"
    assert link.is_symlink() and os.readlink(link) == "../../../common/util/preset_parse.py"
    proc = subprocess.run(
        ["bash", str(SCRIPT), "--cann", str(cann), "--install-path", str(tmp_path / "opp"), "--keep"],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
        env={
            **os.environ,
            "STUB_LOG": str(tmp_path / "calls.log"),
            "STUB_DIR": str(tmp_path),
            "TMPDIR": str(tmp_path),
            "PYTHON": sys.executable,
        },
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    util = next(tmp_path.glob("ms_deepseek_ascend_build.*")) / "project" / "cmake" / "util"
    for name in ("preset_parse.py", "ascendc_bin_param_build.py", "const_var.py", "opdesc_parser.py"):
        assert (util / name).is_file() and not (util / name).is_symlink(), name


def test_template_build_sh_fails_without_its_helpers(tmp_path):
    """The stub's build.sh fails as CANN's does when the staged helpers dangle: python's
    "can't open file", no package (what `cp -r` of the 9.0 template gave)."""
    cann = make_stub_cann(tmp_path, "cann9")
    project = tmp_path / "copied"
    subprocess.run(["cp", "-r", str(cann / "tools/op_project_templates/ascendc/customize"), str(project)], check=True)
    assert (project / "cmake/util/preset_parse.py").is_symlink() and not (
        project / "cmake/util/preset_parse.py"
    ).exists()
    env = {
        **os.environ,
        "STUB_LOG": str(tmp_path / "calls.log"),
        "STUB_DIR": str(tmp_path),
        "ASCEND_HOME_PATH": str(cann),
    }
    proc = subprocess.run(["bash", "build.sh"], cwd=project, capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode != 0
    assert "can't open file" in proc.stderr and "preset_parse.py" in proc.stderr
    assert not list((project / "build_out").glob("*.run"))


def test_dangling_link_in_the_cann_tree_is_reported(tmp_path):
    cann = make_stub_cann(tmp_path, "cann9", break_link="preset_parse.py")
    rc, out = run_build(tmp_path, cann, tmp_path / "opp")
    assert rc == 1
    assert "build_ascend.sh: cannot copy the template" in out and "preset_parse.py" in out
    assert not (tmp_path / "opp" / "vendors").exists()


def test_env_script_that_sets_nothing_is_reported(tmp_path):
    cann = make_stub_cann(tmp_path, "cann9", setenv_extra="return 3")
    (cann / "set_env.sh").write_text('echo setenv >> "$STUB_LOG"\nreturn 3\n')
    rc, out = run_build(tmp_path, cann, tmp_path / "opp")
    assert rc == 1
    assert f"build_ascend.sh: sourcing {cann}/set_env.sh (status 3) set no ASCEND_OPP_PATH folder" in out
    assert calls(tmp_path) == ["setenv"]  # nothing built after the failure


# The CANN 9.0.0 base image (cann-container-image, cann/9.0.0-910b-ubuntu22.04-py3.11/Dockerfile):
# the toolkit is /usr/local/Ascend/cann-9.0.0 with no env script of its own found by the old
# lookup; the image sources /usr/local/Ascend/ascend-toolkit/set_env.sh, and its ENV names both.
def _image_env(cann: Path):
    return {
        "ASCEND_HOME_PATH": str(cann),
        "ASCEND_TOOLKIT_HOME": str(cann),
        "ASCEND_OPP_PATH": str(cann / "opp"),
        "ASCEND_TOOLKIT_LATEST_HOME": str(cann.parent / "ascend-toolkit" / "latest"),
    }


@pytest.mark.parametrize("with_image_env", [False, True])
@pytest.mark.parametrize("via_latest", [False, True])
def test_cann9_image_sources_the_ascend_toolkit_env_script(tmp_path, with_image_env, via_latest):
    cann = make_stub_cann(tmp_path, "cann9", env_at="toolkit")
    latest = cann.parent / "ascend-toolkit" / "latest"
    assert not (cann / "set_env.sh").exists() and latest.resolve() == cann
    # --cann .../ascend-toolkit/latest (the script's default): latest/.. is not ascend-toolkit/
    rc, out = run_build(
        tmp_path,
        latest if via_latest else cann,
        tmp_path / "opp",
        extra_env=_image_env(cann) if with_image_env else None,
    )
    assert rc == 0, out
    assert calls(tmp_path)[:2] == ["setenv", f"build.sh ASCEND_HOME_PATH={cann} CUSTOM_OPP=unset"]
    assert (installed_vendor(tmp_path / "opp") / "version.info").is_file()


def test_env_set_by_the_image_is_used_when_no_env_script_exists(tmp_path):
    cann = make_stub_cann(tmp_path, "cann9", env_at="none")
    rc, out = run_build(tmp_path, cann, tmp_path / "opp", extra_env=_image_env(cann))
    assert rc == 0, out
    assert f"no CANN env script found; using the environment already set for {cann}" in out
    assert "setenv" not in calls(tmp_path)
    assert calls(tmp_path)[0] == f"build.sh ASCEND_HOME_PATH={cann} CUSTOM_OPP=unset"


def test_no_env_script_and_no_environment_is_reported(tmp_path):
    cann = make_stub_cann(tmp_path, "cann9", env_at="none")
    rc, out = run_build(tmp_path, cann, tmp_path / "opp")
    assert rc == 1
    assert "build_ascend.sh: no CANN env script (" in out and f"no CANN environment set for {cann}" in out
    assert calls(tmp_path) == []


def test_another_releases_toolkit_env_script_is_not_sourced(tmp_path):
    """ascend-toolkit/latest names another release: its set_env.sh would set that release's paths."""
    cann = make_stub_cann(tmp_path, "cann9", env_at="toolkit")
    latest = cann.parent / "ascend-toolkit" / "latest"
    latest.unlink()
    (cann.parent / "cann-8.5.0").mkdir()
    latest.symlink_to("../cann-8.5.0")
    rc, out = run_build(tmp_path, cann, tmp_path / "opp")
    assert rc == 1 and "no CANN env script" in out
    assert calls(tmp_path) == []


def _code(path: Path) -> str:
    """C++ source without comments (a comment naming SyncAll is not a barrier)."""
    return re.sub(r"//[^\n]*|/\*.*?\*/", "", path.read_text(), flags=re.S)


@pytest.mark.parametrize("op", ["expert_lookup", "fp32_softmax", "repetition_penalty"])
def test_kernels_with_a_hardware_barrier_are_scheduled_in_batch_mode(op):
    """A kernel that calls SyncAll() must be declared mixed (KERNEL_TYPE_MIX_AIV_1_0, so CANN sets
    up FFTS; design.md section 7) and its tiling must ask for batch mode, SetScheduleMode(1) (CANN
    9.0.0 TilingContext::SetScheduleMode: without it barrier kernels on two streams can deadlock)."""
    kernel = _code(REPO / "ops" / op / "op_kernel" / f"{op}.cpp")
    host = _code(REPO / "ops" / op / "op_host" / f"{op}.cpp")
    barrier = re.search(r"\bSyncAll\s*(<[^>]*>)?\s*\(", kernel) is not None
    assert barrier == (op == "expert_lookup")
    assert ("KERNEL_TYPE_MIX_AIV_1_0" in kernel) == barrier
    assert (re.search(r"SetScheduleMode\(1\)", host) is not None) == barrier


def _ops_copy(tmp_path: Path) -> Path:
    """A copy of ops/ (build_ascend.sh stages the sources next to itself) to plant mistakes in."""
    copy = tmp_path / "ops_copy"
    shutil.copytree(REPO / "ops", copy)
    return copy


HOST = "fp32_softmax/op_host/fp32_softmax.cpp"
KERNEL = "fp32_softmax/op_kernel/fp32_softmax.cpp"
OP_FILE = '        .ExtendCfgInfo("opFile.value", "fp32_softmax")\n'
OP_INTERFACE = '        .ExtendCfgInfo("opInterface.value", "fp32_softmax");\n'
NO_OP_FILE = "stub opbuild: Fp32Softmax: the ascend910b config sets no opFile.value"


@pytest.mark.parametrize(
    "source, planted, replacement, message",
    [
        # the kernel file name left to opbuild's own rule (what does Fp32Softmax become at the digit?)
        (HOST, OP_FILE, "", NO_OP_FILE),
        # the same, commented out: the compiler never sees a comment
        (HOST, OP_FILE, '        // .ExtendCfgInfo("opFile.value", "fp32_softmax")\n', NO_OP_FILE),
        # the config holding the names is built, but the SoC's AddConfig registers the default one
        (HOST, 'AddConfig("ascend910b", config);', 'AddConfig("ascend910b");', NO_OP_FILE),
        # a file name with no op_kernel/<name>.cpp: CANN's template builds no kernel
        (HOST, '"opFile.value", "fp32_softmax"', '"opFile.value", "fp32softmax"', "[ERROR]: operator: fp32softmax "),
        # the entry name left to opbuild's rule
        (HOST, OP_INTERFACE, ";\n", "stub opbuild: Fp32Softmax: the ascend910b config sets no opInterface.value"),
        # the kernel's entry is not the name the compiler renames per tiling key
        (
            KERNEL,
            "__aicore__ void fp32_softmax(",
            "__aicore__ void fp_32_softmax(",
            "stub compile: Fp32Softmax: op_kernel/fp32_softmax.cpp defines no kernel entry fp32_softmax "
            "(opInterface.value; found: fp_32_softmax)",
        ),
    ],
    ids=[
        "op_file_removed",
        "op_file_commented_out",
        "add_config_without_config",
        "op_file_misnamed",
        "op_interface_removed",
        "kernel_entry_renamed",
    ],
)
def test_planted_naming_mistakes_fail_the_build(tmp_path, source, planted, replacement, message):
    """The OpDef must name the kernel file (opFile.value) and entry (opInterface.value) in the config
    each SoC's AddConfig registers, and op_kernel/<opFile>.cpp must define that entry: each planted
    mistake fails the (stub) build and installs nothing."""
    ops = _ops_copy(tmp_path)
    path = ops / source
    assert path.read_text().count(planted) == 1, (source, planted)
    path.write_text(path.read_text().replace(planted, replacement))
    cann = make_stub_cann(tmp_path, "cann9")
    rc, out = run_build(tmp_path, cann, tmp_path / "opp", script=ops / "build_ascend.sh")
    assert rc == 1 and message in out, out
    assert "build_ascend.sh: build failed" in out
    assert not (tmp_path / "opp" / "vendors").exists()


def test_failing_compile_is_reported_and_nothing_installed(tmp_path):
    cann = make_stub_cann(tmp_path, "cann9", build_fail='echo "error: op_kernel/expert_lookup.cpp:67 boom"; exit 2')
    rc, out = run_build(tmp_path, cann, tmp_path / "opp")
    assert rc == 1
    assert "error: op_kernel/expert_lookup.cpp:67 boom" in out  # the compiler's own lines are shown
    assert "build_ascend.sh: build failed" in out
    assert not (tmp_path / "opp" / "vendors").exists()


def test_build_install_then_mindspore_registers_the_ops(tmp_path, monkeypatch):
    """build -> install -> installed_op_types() -> MindSpore's CustomInfoGenerator (the code
    ops.Custom(func_type="aot") runs on Ascend to register an installed op) on the same files."""
    import mindspore.ops.operations._custom_ops_utils as custom_utils

    from ms_deepseek.ops import ascend

    cann = make_stub_cann(tmp_path, "cann9")
    install = tmp_path / "opp"
    rc, out = run_build(tmp_path, cann, install)
    assert rc == 0, out
    monkeypatch.setenv("ASCEND_CUSTOM_OPP_PATH", str(installed_vendor(install)))
    monkeypatch.setenv("ASCEND_OPP_PATH", str(cann / "opp"))
    monkeypatch.setattr(custom_utils, "MSContext", FakeAscendContext("ascend910b"))
    monkeypatch.setattr(ascend, "soc_version", lambda: "ascend910b")
    assert ascend.installed_op_types() == OP_TYPES
    for op_type in sorted(OP_TYPES):
        gen = custom_utils.CustomInfoGenerator(op_type)
        reg = gen.generate_custom_reg_op()
        assert reg["op_name"] == op_type
        types = custom_utils.CustomInfoGenerator(op_type).get_aclnn_api_types()
        assert types[-2:] == ["uint64_t*", "aclOpExecutor**"], types
    reg = custom_utils.CustomInfoGenerator("RepetitionPenalty").generate_custom_reg_op()
    assert [i["name"] for i in reg["inputs"]] == ["logits", "ids"] and [o["name"] for o in reg["outputs"]] == ["y"]
    assert [(a["name"], a["type"]) for a in reg["attr"]] == [("penalty", "float")]
    assert custom_utils.CustomInfoGenerator("RepetitionPenalty").get_aclnn_api_types() == [
        "aclTensor*",
        "aclTensor*",
        "double",
        "aclTensor*",
        "uint64_t*",
        "aclOpExecutor**",
    ]

    # Another SoC: MindSpore reads only the running SoC's folder, and so do we.
    monkeypatch.setattr(custom_utils, "MSContext", FakeAscendContext("ascend910_93"))
    monkeypatch.setattr(ascend, "soc_version", lambda: "ascend910_93")
    assert ascend.installed_op_types() == set()
    with pytest.raises(RuntimeError, match=r"Cannot find operator \[RepetitionPenalty\]"):
        custom_utils.CustomInfoGenerator("RepetitionPenalty").generate_custom_reg_op()


def _registered_socs():
    """The SoCs every OpDef registers an AICore config for (AddConfig("<soc>", ...))."""
    per_op = [
        set(re.findall(r'AddConfig\("(\w+)"', path.read_text()))
        for path in sorted((REPO / "ops").glob("*/op_host/*.cpp"))
    ]
    assert len(per_op) == 3 and all(per_op)
    return set.intersection(*per_op), set.union(*per_op)


@pytest.mark.parametrize("soc", ["ascend310p", "ascend310b", "ascend910", "ascend910b", "ascend910_93"])
def test_soc_accepted_only_if_every_opdef_registers_it(soc):
    from ms_deepseek.ops.ascend import SUPPORTED_SOCS

    common, anywhere = _registered_socs()
    assert common == anywhere == set(SUPPORTED_SOCS) == {"ascend910b", "ascend910_93"}
    proc = subprocess.run(
        ["bash", str(SCRIPT), "--soc", soc, "--cann", "/nonexistent/cann"],
        capture_output=True,
        text=True,
        timeout=30,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    if soc in common:
        assert lines[0] == "build_ascend.sh: CANN not found at /nonexistent/cann (pass --cann or set ASCEND_HOME_PATH)"
    else:
        assert lines[0].startswith(
            f"build_ascend.sh: --soc: unsupported SoC '{soc}': the operators are registered "
            "for ascend910b (Atlas 800T A2) and ascend910_93 (Atlas A3) only"
        )


@pytest.mark.parametrize(
    "args, message",
    [
        (["--soc", "ascend999"], "--soc: unsupported SoC 'ascend999'"),
        (["--cann", "/nonexistent/cann"], "CANN not found at /nonexistent/cann"),
        (["--bogus"], "unknown argument --bogus"),
    ],
)
def test_bad_arguments(tmp_path, args, message):
    proc = subprocess.run(
        ["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL
    )
    assert proc.returncode != 0
    assert message in proc.stderr


# ----------------------------------------------------------------- tools/ascend_dryrun.sh
DRYRUN = REPO / "tools" / "ascend_dryrun.sh"


def dryrun(*args, env=None):
    full_env = {k: v for k, v in os.environ.items() if k not in ("ASCEND_HOME_PATH",)}
    full_env.update(env or {})
    return subprocess.run(
        ["bash", str(DRYRUN), *args],
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
        env=full_env,
    )


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
        assert "env MS_DEEPSEEK_DEVICE=Ascend " in line
        assert " train " in line and "--max-steps 1" in line and "num_hidden_layers=16" in line
        assert f"> {tmp_path}/dr/rank_{8 * stage}/dryrun.log" in line
    assert not (tmp_path / "dr").exists()  # print-only writes nothing


def test_dryrun_print_only_passes_overrides_and_level(tmp_path):
    proc = dryrun(
        str(REPO / "recipes" / "v2-lite-sft-8npu.yaml"),
        "--print-only",
        "--level",
        "1",
        "--layers",
        "3",
        "--set",
        "train.micro_batch_size=1",
    )
    assert proc.returncode == 0, proc.stderr
    ranks = [line for line in proc.stdout.splitlines() if line.startswith("stage ")]
    assert len(ranks) == 1 and "MS_SIMULATION_LEVEL=1 RANK_SIZE=8 RANK_ID=0 " in ranks[0]
    assert "num_hidden_layers=3" in ranks[0] and "--set train.micro_batch_size=1" in ranks[0]


def test_dryrun_level_0_is_the_compile_check(tmp_path):
    """One documented way to compile: level 0 is `plan --recipe R --compile` (any machine)."""
    proc = dryrun(str(REPO / "recipes" / "v2-lite-sft-8npu.yaml"), "--print-only", "--level", "0")
    assert proc.returncode == 2 and "plan --recipe" in proc.stderr and "--compile" in proc.stderr, proc.stderr


@pytest.mark.parametrize(
    "args, message",
    [
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
    ],
)
def test_dryrun_bad_arguments(args, message):
    recipe = str(REPO / "recipes" / "v2-sft-64npu.yaml")
    proc = dryrun(*[recipe if a == "@recipe" else a for a in args])
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr


def test_dryrun_help():
    proc = dryrun("--help")
    assert proc.returncode == 0 and "MS_SIMULATION_LEVEL" in proc.stdout and "--print-only" in proc.stdout
    text = " ".join(proc.stdout.split())
    assert "0 compiles only and 1 adds each operator's input/output memory: both use CPU only" in text
    assert "2 adds operator workspaces and 3 runs the compute kernels: both also need the compute resources" in text


# A stand-in for the `ms-deepseek` the dry run starts: `plan` runs as is; `train` runs the real
# command up to the two calls where MindSpore takes over (set_device, then the dry run's
# simulated init()), records what the worker got there, and stops.
STUB_CLI = r"""#!@PYTHON@
import json, os, sys
args = sys.argv[1:]
if args[0] == "train":
    import mindspore as ms
    import mindspore.communication as comm
    keys = ("MS_DEEPSEEK_DEVICE", "MS_SIMULATION_LEVEL", "RANK_SIZE", "RANK_ID", "ASCEND_HOME_PATH")
    record = {"env": {k: os.environ.get(k) for k in keys}, "argv": args}

    def set_device(target, *a, **k):
        record["set_device"] = target

    def init(*a, **k):
        record["init"] = True
        with open(os.path.join(os.environ["RECORD_DIR"], f"rank_{os.environ['RANK_ID']}.json"), "w") as f:
            json.dump(record, f)
        os._exit(0)

    ms.set_device, comm.init = set_device, init
from ms_deepseek.cli import main
sys.exit(main(args))
"""


def test_dryrun_workers_select_ascend_on_a_host_without_npus(tmp_path):
    cann = make_stub_cann(tmp_path, "cann9")
    cli = tmp_path / "ms-deepseek"
    cli.write_text(STUB_CLI.replace("@PYTHON@", sys.executable))
    cli.chmod(0o755)
    records = tmp_path / "records"
    records.mkdir()
    path = ":".join(p for p in os.environ["PATH"].split(":") if not (Path(p) / "npu-smi").exists())
    proc = dryrun(
        str(REPO / "recipes" / "v2-lite-sft-8npu.yaml"),
        "--cann",
        str(cann),
        "--layers",
        "2",
        "--out",
        str(tmp_path / "dr"),
        "--set",
        "model.source=deepseek-v2-lite",
        "--set",
        "data.path=null",
        "--set",
        "data.format=pretrain",
        env={
            "MS_DEEPSEEK_CLI": str(cli),
            "RECORD_DIR": str(records),
            "STUB_LOG": str(tmp_path / "log"),
            "PYTHONPATH": str(REPO),
            "PATH": path,
            "PYTHON": sys.executable,
        },
    )
    assert proc.returncode == 0, (
        proc.stdout + proc.stderr + "".join(p.read_text() for p in (tmp_path / "dr").glob("rank_*/dryrun.log"))
    )
    got = json.loads((records / "rank_0.json").read_text())  # one stage: rank 0
    assert got["set_device"] == "Ascend" and got["init"]
    assert got["env"] == {
        "MS_DEEPSEEK_DEVICE": "Ascend",
        "MS_SIMULATION_LEVEL": "1",
        "RANK_SIZE": "8",
        "RANK_ID": "0",
        "ASCEND_HOME_PATH": str(cann),
    }
    assert "model.overrides.num_hidden_layers=2" in got["argv"]
    assert (tmp_path / "dr" / "summary.json").is_file()


def test_dryrun_refuses_levels_that_need_npus_without_npu_smi(tmp_path):
    cann = make_stub_cann(tmp_path, "cann9")
    path = ":".join(p for p in os.environ["PATH"].split(":") if not (Path(p) / "npu-smi").exists())
    proc = dryrun(
        str(REPO / "recipes" / "v2-lite-sft-8npu.yaml"),
        "--cann",
        str(cann),
        "--level",
        "2",
        "--out",
        str(tmp_path / "dr"),
        env={"PATH": path, "STUB_LOG": str(tmp_path / "log")},
    )
    assert proc.returncode == 2
    assert "--level 2: levels 2 and 3 need the simulated cards' compute resources (NPUs)" in proc.stderr
