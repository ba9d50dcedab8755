"""Level-1 doctor checks: one host, one device.

Versions against the pins in requirements.txt, the CANN toolkit against the
release MindSpore was built for, the NPU driver / health / ECC counters from
``npu-smi``, ``vm.swappiness``, free disk where checkpoints go, and a 10-step
smoke training run of the tiny model.
"""

from __future__ import annotations

import json
import math
import os
import platform
import sys
import tempfile
from typing import List, Optional, Tuple

from ms_deepseek.core.errors import UserError
from ms_deepseek.core.runtime import SUPPORTED_MINDSPORE_LINES, check_mindspore_version
from ms_deepseek.doctor import npu_parse, pins
from ms_deepseek.doctor.core import (
    NO_NPU,
    CheckResult,
    DoctorContext,
    check,
    failed,
    passed,
    skipped,
    warned,
)

GIB = 1024**3


# ---------------------------------------------------------------------------------------------
# shared probes (memoised per doctor run)


def npu_state(ctx: DoctorContext) -> Tuple[str, Optional[str], List[npu_parse.NpuDevice], str]:
    """("absent" | "error" | "ok", driver version, devices, raw output or error)."""

    def compute():
        result = ctx.probe.run(["npu-smi", "info"], timeout=60)
        if result is None:
            return "absent", None, [], "npu-smi not found"
        if not result.ok:
            lines = (result.stderr or result.stdout).strip().splitlines()
            return "error", None, [], lines[-1] if lines else f"exit code {result.returncode}"
        version, devices = npu_parse.parse_npu_smi_info(result.stdout)
        return "ok", version, devices, result.stdout

    return ctx.memo("npu-smi info", compute)


def has_npu(ctx: DoctorContext) -> bool:
    """An NPU host: npu-smi is installed or /dev/davinci* device nodes exist."""
    state = npu_state(ctx)[0]
    return state != "absent" or bool(ctx.probe.glob("/dev/davinci[0-9]*"))


def npu_error(ctx: DoctorContext) -> Optional[CheckResult]:
    """The shared verdict when npu-smi is missing or broken (None when it answered)."""
    state, _, devices, raw = npu_state(ctx)
    if state == "absent":
        return (
            skipped(NO_NPU)
            if not has_npu(ctx)
            else failed(
                "/dev/davinci* exists but npu-smi is not installed",
                "install the Ascend driver package (npu-smi ships with it) or mount /usr/local/sbin/npu-smi "
                "into the container",
            )
        )
    if state == "error":
        return failed(
            f"npu-smi info failed: {raw}",
            "reinstall or reload the Ascend driver (npu-smi info must list the devices); check dmesg",
        )
    if not devices:
        return failed(
            "npu-smi info lists no device",
            "check that the driver is loaded and, in a container, that /dev/davinci* and "
            "/dev/davinci_manager are passed with --device",
        )
    return None


# ---------------------------------------------------------------------------------------------
# versions


def _pins(ctx: DoctorContext):
    return ctx.memo("pins", lambda: pins.read_pins(ctx.requirements))


@check("python", 1, "Python version")
def check_python(ctx: DoctorContext) -> CheckResult:
    version = platform.python_version()
    spec = pins.python_requires()
    if spec is None:
        return warned(
            f"Python {version}; setup.py's python_requires could not be found",
            "run doctor from a checkout or an installed ms-deepseek",
        )
    if not pins.satisfies(version, spec):
        return failed(
            f"Python {version} is outside python_requires {spec}",
            f"create the environment with a Python matching {spec} (3.11 is what CI uses)",
        )
    return passed(f"Python {version} ({sys.executable}) matches {spec}")


def _check_pinned(ctx: DoctorContext, name: str, extra: str = "") -> CheckResult:
    source, pinned = _pins(ctx)
    pin = pinned.get(pins.normalize(name))
    found = pins.installed_version(name)
    if pin is None:
        return warned(
            f"{name} {found or 'not installed'}; {source} has no pin for it",
            f"add {name}==<version> to requirements.txt",
        )
    if found is None:
        return failed(
            f"{name} is not installed (pinned {pin.spec} in {source})",
            f"pip install -r requirements.txt  (or pip install '{name}{pin.spec}')",
        )
    if not pins.satisfies(found, pin.spec):
        return failed(
            f"{name} {found} does not match the pin {pin.spec} in {source}{extra}", f"pip install '{name}{pin.spec}'"
        )
    return passed(f"{name} {found} matches {pin.spec}")


@check("mindspore", 1, "MindSpore version")
def check_mindspore(ctx: DoctorContext) -> CheckResult:
    """The installed MindSpore's line (one of ``core/runtime.SUPPORTED_MINDSPORE_LINES``) and its pin."""
    found = pins.installed_version("mindspore")
    if found is None:
        return _check_pinned(ctx, "mindspore")
    try:
        line = check_mindspore_version(found)
    except UserError as err:
        return failed(str(err), f"pip install -e . (MindSpore {SUPPORTED_MINDSPORE_LINES[0]}.x)")
    result = _check_pinned(ctx, "mindspore")
    result.message += f"; MindSpore line {line} (supported: {', '.join(SUPPORTED_MINDSPORE_LINES)})"
    return result


@check("numpy", 1, "numpy version")
def check_numpy(ctx: DoctorContext) -> CheckResult:
    found = pins.installed_version("numpy") or ""
    extra = " (MindSpore 2.9 breaks with numpy 2)" if found.startswith("2.") else ""
    return _check_pinned(ctx, "numpy", extra)


@check("packages", 1, "other pinned packages")
def check_packages(ctx: DoctorContext) -> CheckResult:
    source, pinned = _pins(ctx)
    missing, different = [], []
    for key, pin in pinned.items():
        if key in ("mindspore", "numpy"):
            continue
        found = pins.installed_version(pin.name)
        if found is None:
            missing.append(f"{pin.name}{pin.spec}")
        elif not pins.satisfies(found, pin.spec):
            different.append(f"{pin.name} {found} (pinned {pin.spec})")
    if missing:
        return failed(f"not installed: {', '.join(missing)}", "pip install -r requirements.txt")
    if different:
        return warned(
            f"versions differ from {source}: {', '.join(different)}",
            "pip install -r requirements.txt (the pins are what CI tests)",
        )
    return passed(f"{len(pinned) - 2} other pinned packages match {source}")


# ---------------------------------------------------------------------------------------------
# CANN


def cann_roots(ctx: DoctorContext) -> List[str]:
    """Candidate CANN install roots, most specific first."""
    roots = []
    for var in ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME"):
        value = ctx.probe.env(var)
        if value:
            roots.append(value.rstrip("/"))
    home = ctx.probe.env("HOME") or os.path.expanduser("~")
    for base in ("/usr/local/Ascend", f"{home}/Ascend"):
        roots += [f"{base}/cann", f"{base}/ascend-toolkit/latest"]
        roots += sorted(ctx.probe.glob(f"{base}/cann-*"), reverse=True)
    seen, ordered = set(), []
    for r in roots:
        if r not in seen:
            seen.add(r)
            ordered.append(r)
    return ordered


def find_cann(ctx: DoctorContext) -> Optional[Tuple[str, str, str]]:
    """(root, version file, CANN release) of the first toolkit found, or None."""
    for root in cann_roots(ctx):
        candidates = ctx.probe.glob(f"{root}/*-linux/ascend_toolkit_install.info") + [f"{root}/version.cfg"]
        for path in candidates:
            text = ctx.probe.read_file(path)
            if text:
                version = npu_parse.parse_cann_version(text)
                if version:
                    return root, path, version
    return None


@check("cann", 1, "CANN toolkit version")
def check_cann(ctx: DoctorContext) -> CheckResult:
    ms_version = pins.installed_version("mindspore") or "?"
    wanted = pins.MINDSPORE_CANN.get(ms_version)
    found = find_cann(ctx)
    npu = has_npu(ctx)
    if found is None:
        if not npu:
            return skipped(f"{NO_NPU} (and no CANN toolkit installed)")
        need = f"CANN {wanted[0]}" if wanted else "the CANN release matching MindSpore " + ms_version
        return failed(
            "CANN toolkit not found (ASCEND_HOME_PATH unset; no version file under /usr/local/Ascend)",
            f"install {need} (toolkit + 910b ops) and `source /usr/local/Ascend/cann/set_env.sh` "
            "(or ascend-toolkit/set_env.sh)",
        )
    root, path, version = found
    if wanted is None:
        return warned(
            f"CANN {version} at {root}; no known CANN pairing for MindSpore {ms_version}",
            "check the MindSpore install guide's version table",
        )
    if not npu_parse.cann_release_matches(version, wanted[0]):
        fix = f"install CANN {wanted[0]} (MindSpore {ms_version} is built for it; driver {wanted[1]} or newer)"
        msg = f"CANN {version} ({path}) but MindSpore {ms_version} needs CANN {wanted[0]}"
        return failed(msg, fix) if npu else warned(msg + " (no NPU here)", fix)
    if npu and not ctx.probe.env("ASCEND_HOME_PATH"):
        return warned(
            f"CANN {version} found at {root} but its environment is not set (ASCEND_HOME_PATH unset)",
            f"source {root}/set_env.sh before training (the Docker image's entrypoint does it)",
        )
    return passed(f"CANN {version} at {root} matches MindSpore {ms_version}", root=root, version=version)


# ---------------------------------------------------------------------------------------------
# NPU driver, health, ECC


@check("npu_devices", 1, "NPU visible and driver version")
def check_npu_devices(ctx: DoctorContext) -> CheckResult:
    bad = npu_error(ctx)
    if bad:
        return bad
    _, driver, devices, _ = npu_state(ctx)
    names = sorted({d.name for d in devices})
    driver_info = ctx.probe.read_file("/usr/local/Ascend/driver/version.info") or ""
    for line in driver_info.splitlines():
        if line.lower().startswith("version="):
            driver = line.split("=", 1)[1].strip()
    msg = f"{len(devices)} NPU(s) visible ({', '.join(names)}), driver {driver or 'unknown'}"
    ms_version = pins.installed_version("mindspore") or ""
    wanted = pins.MINDSPORE_CANN.get(ms_version)
    if driver and wanted and npu_parse.parse_version_tuple(driver)[:1] < (25,):
        return warned(
            msg + f"; CANN {wanted[0]} is paired with driver {wanted[1]} (HDK 25.0 or newer)",
            f"upgrade the Ascend driver and firmware to {wanted[1]}",
        )
    return passed(msg, devices=[d.npu_id for d in devices], driver=driver)


@check("npu_health", 1, "NPU health status")
def check_npu_health(ctx: DoctorContext) -> CheckResult:
    bad = npu_error(ctx)
    if bad:
        return bad
    devices = npu_state(ctx)[2]
    unhealthy = [(d.npu_id, d.health) for d in devices if d.health.upper() != "OK"]
    if not unhealthy:
        return passed(f"all {len(devices)} NPU(s) report Health OK")
    text = ", ".join(f"NPU {i}: {h}" for i, h in unhealthy)
    fix = (
        "run `npu-smi info -t health -i <id>` for the error code; take the device out of the job and "
        "reset it (`npu-smi set -t reset -i <id> -c 0`) or call the hardware vendor"
    )
    if all(h.lower() == "warning" for _, h in unhealthy):
        return warned(f"health warning: {text}", fix)
    return failed(f"unhealthy: {text}", fix)


HBM_BUSY_FRACTION = 0.15  # an idle 910B shows a few percent in use (driver reserve); more means a tenant


@check("npu_memory", 1, "NPU HBM free before training")
def check_npu_memory(ctx: DoctorContext) -> CheckResult:
    bad = npu_error(ctx)
    if bad:
        return bad
    devices = [d for d in npu_state(ctx)[2] if d.hbm_total_mb]
    if not devices:
        return warned("npu-smi shows no HBM usage column", "run `npu-smi info` by hand")
    busy = [
        f"NPU {d.npu_id}: {d.hbm_used_mb / 1024:.1f} of {d.hbm_total_mb / 1024:.0f} GB in use"
        for d in devices
        if d.hbm_used_mb > HBM_BUSY_FRACTION * d.hbm_total_mb
    ]
    if busy:
        return warned(
            "HBM already taken by another process: " + "; ".join(busy),
            "find it with `npu-smi info` (process table) and stop it, or the run may fail with out-of-memory at start",
        )
    worst = max(d.hbm_used_mb / d.hbm_total_mb for d in devices)
    return passed(f"HBM free on all {len(devices)} NPU(s) (at most {100 * worst:.0f}% in use)")


@check("npu_ecc", 1, "NPU HBM ECC error counters")
def check_npu_ecc(ctx: DoctorContext) -> CheckResult:
    bad = npu_error(ctx)
    if bad:
        return bad
    devices = npu_state(ctx)[2]
    uncorrectable, corrected, unread = [], [], []
    for d in devices:
        result = ctx.probe.run(["npu-smi", "info", "-t", "ecc", "-i", str(d.npu_id)], timeout=30)
        if result is None or not result.ok or not npu_parse.parse_ecc(result.stdout):
            unread.append(d.npu_id)
            continue
        hard, soft = npu_parse.ecc_verdict(npu_parse.parse_ecc(result.stdout))
        if hard:
            uncorrectable.append(f"NPU {d.npu_id} " + ", ".join(f"{k}={v}" for k, v in hard.items()))
        if soft:
            corrected.append(f"NPU {d.npu_id} " + ", ".join(f"{k}={v}" for k, v in soft.items()))
    if uncorrectable:
        return failed(
            "uncorrectable HBM ECC errors: " + "; ".join(uncorrectable),
            "drain the device (it can corrupt training silently or crash it); reset it, and if the "
            "counters return have the board replaced",
        )
    if corrected:
        return warned(
            "corrected (single-bit) HBM ECC errors: " + "; ".join(corrected),
            "watch the counters; a growing count predicts uncorrectable errors: plan a replacement",
        )
    if unread:
        return warned(
            f"could not read ECC counters of NPU {', '.join(map(str, unread))}",
            "run `npu-smi info -t ecc -i <id>` by hand (needs root on some drivers)",
        )
    return passed(f"ECC error counters are zero on all {len(devices)} NPU(s)")


# ---------------------------------------------------------------------------------------------
# host settings


@check("swappiness", 1, "vm.swappiness")
def check_swappiness(ctx: DoctorContext) -> CheckResult:
    text = ctx.probe.read_file("/proc/sys/vm/swappiness")
    if text is None or not text.strip().isdigit():
        return skipped("cannot read /proc/sys/vm/swappiness")
    value = int(text.strip())
    swap_kb = None
    for line in (ctx.probe.read_file("/proc/meminfo") or "").splitlines():
        if line.startswith("SwapTotal:"):
            swap_kb = int(line.split()[1])
    if swap_kb == 0:  # nothing to page out to: the setting has no effect
        return passed(f"no swap configured (vm.swappiness {value} has no effect)")
    swap = "" if swap_kb is None else f" (swap configured: {swap_kb / 1024**2:.1f} GiB)"
    if value > 10:
        return warned(
            f"vm.swappiness is {value}{swap}: the kernel pages out host memory of a training process "
            "under pressure and steps slow down",
            "sysctl -w vm.swappiness=1 and persist it in /etc/sysctl.d/99-ms-deepseek.conf",
        )
    return passed(f"vm.swappiness is {value}{swap}")


@check("disk_space", 1, "free disk where checkpoints go")
def check_disk_space(ctx: DoctorContext) -> CheckResult:
    found = ctx.probe.disk_free(ctx.checkpoint_dir)
    if found is None:
        return failed(
            f"cannot stat {ctx.checkpoint_dir} or any of its parents",
            "pass --checkpoint-dir pointing at the checkpoint volume",
        )
    where, free = found
    free_gb = free / GIB
    msg = f"{free_gb:.1f} GiB free at {where} (checkpoints: {ctx.checkpoint_dir})"
    if ctx.need_gb is not None:
        if free_gb < ctx.need_gb:
            return failed(
                msg + f", need {ctx.need_gb:g} GiB",
                "free space, or train into a larger volume (train --output DIR; check it with doctor --checkpoint-dir DIR)",
            )
        if free_gb < 1.2 * ctx.need_gb:
            return warned(
                msg + f", less than 20% above the {ctx.need_gb:g} GiB needed",
                "free space or keep fewer checkpoints (checkpoint.keep_last)",
            )
        return passed(msg)
    if free_gb < 1:
        return failed(
            msg,
            "free space, or train into a larger volume (train --output DIR; check it with doctor --checkpoint-dir DIR)",
        )
    if free_gb < 20:
        return warned(
            msg + "; a V2-Lite checkpoint with optimizer state is hundreds of GiB",
            "pass --need-gb for the run's checkpoint size, or use a larger volume",
        )
    return passed(msg)


# ---------------------------------------------------------------------------------------------
# smoke run


def smoke_command(ctx: DoctorContext) -> List[str]:
    return [sys.executable, "-m", "ms_deepseek.doctor.smoke", "--steps", str(ctx.smoke_steps), "--json"]


def parse_smoke_output(stdout: str) -> Optional[dict]:
    """The last JSON object line the smoke run printed."""
    for line in reversed(stdout.strip().splitlines()):
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            try:
                return json.loads(line)
            except ValueError:
                continue
    return None


def smoke_verdict(report: dict) -> CheckResult:
    losses = [float(x) for x in report.get("losses", [])]
    where = f"{report.get('device', '?')}, {report.get('mode', 'graph')} mode, {report.get('seconds', 0):.1f} s"
    if len(losses) < 2:
        return failed(f"smoke run reported {len(losses)} loss value(s)", "run `python -m ms_deepseek.doctor.smoke`")
    if not all(math.isfinite(x) for x in losses):
        return failed(
            f"smoke run loss is not finite: {losses}",
            "the tiny model diverges on this backend: check the MindSpore / CANN install and "
            "compute dtype (float32 on CPU)",
        )
    first, last = losses[0], losses[-1]
    if not last < 0.95 * first:
        return failed(
            f"smoke run loss did not fall over {len(losses)} steps: {first:.4f} -> {last:.4f} ({where})",
            "the optimizer step has no effect: check the installed MindSpore and ms_deepseek versions",
        )
    return passed(f"tiny model trained {len(losses)} steps, loss {first:.4f} -> {last:.4f} ({where})", losses=losses)


@check("smoke_train", 1, "tiny model trains for 10 steps", heavy=True)
def check_smoke_train(ctx: DoctorContext) -> CheckResult:
    if not ctx.smoke:
        return skipped("smoke run disabled (--no-smoke)")
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {
        "PYTHONPATH": os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH", "")) if p),
        "GLOG_v": os.environ.get("GLOG_v", "3"),
    }
    with tempfile.TemporaryDirectory(prefix="ms_deepseek_smoke_") as tmp:  # compile droppings land here
        result = ctx.probe.run(smoke_command(ctx), timeout=ctx.timeout, env=env, cwd=tmp)
    if result is None:
        return failed("could not start the smoke run", f"check that {sys.executable} runs")
    report = parse_smoke_output(result.stdout)
    if report is None or not result.ok:
        tail = (result.stderr or result.stdout).strip().splitlines()[-1:] or [f"exit code {result.returncode}"]
        if report and report.get("error"):
            tail = [report["error"]]
        return failed(
            f"smoke run failed: {tail[0][:300]}", "run `python -m ms_deepseek.doctor.smoke` to see the full error"
        )
    return smoke_verdict(report)
