"""ms-deepseek doctor: parsers, every check's verdict on recorded healthy and broken hosts,
the CLI, and the real level-1 run (with the smoke training run) on this machine."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ms_deepseek.cli.doctor import exit_code, format_line, run_doctor, select_checks, to_json
from ms_deepseek.doctor import npu_parse, pins
from ms_deepseek.doctor.core import (
    FAIL,
    PASS,
    REGISTRY,
    SKIP,
    WARN,
    CheckResult,
    DoctorContext,
    checks_for_level,
    run_check,
)
from ms_deepseek.doctor.host import parse_smoke_output, smoke_verdict
from ms_deepseek.doctor.probe import CommandResult, RecordedProbe

from repo_paths import FIXTURES, REPO

FIX = FIXTURES / "doctor"


def probe(name: str) -> RecordedProbe:
    base = RecordedProbe.from_dir(FIX / "healthy")
    return base if name == "healthy" else RecordedProbe.from_dir(FIX / name, base=base)


def ctx_for(name: str, level: int = 8, **kw) -> DoctorContext:
    kw.setdefault("smoke", False)
    kw.setdefault("checkpoint_dir", "/data/runs")
    return DoctorContext(probe=probe(name), level=level, **kw)


def verdict(name: str, check_id: str, level: int = 8, **kw) -> CheckResult:
    return run_check(REGISTRY[check_id], ctx_for(name, level, **kw))


# ------------------------------------------------------------------------------- parsers


def test_parse_npu_smi_table_stops_at_process_table():
    version, devices = npu_parse.parse_npu_smi_info((FIX / "healthy" / "npu_smi_info.txt").read_text())
    assert version == "26.0.rc1"
    assert [d.npu_id for d in devices] == list(range(8))
    assert {d.name for d in devices} == {"910B3"} and {d.health for d in devices} == {"OK"}
    assert devices[0].bus_id == "0000:C1:00.0" and devices[0].hbm_total_mb == 65536 and devices[3].hbm_used_mb == 3303
    text = """| NPU     Chip              | Process id    | Process name             | Process memory(MB)      |
| 0       0                 | 111           | python                   | 37974                   |"""
    assert npu_parse.parse_npu_smi_info(text)[1] == []


def test_parse_ecc_hccn_mtu_iplink_cann():
    counts = npu_parse.parse_ecc((FIX / "ecc_errors" / "ecc_3.txt").read_text())
    hard, soft = npu_parse.ecc_verdict(counts)
    assert hard == {
        "HBM Double Bit Error Count": 2,
        "HBM Double Bit Aggregate Total Err Cnt": 2,
        "HBM Double Bit Isolated Pages Count": 1,
    }
    assert soft == {"HBM Single Bit Error Count": 12, "HBM Single Bit Aggregate Total Err Cnt": 12}
    entries, bad = npu_parse.parse_hccn_conf("address_0=1.2.3.4\nnetmask_0=255.0.0.0\n# comment\nbogus line\n")
    assert entries == {0: {"address": "1.2.3.4", "netmask": "255.0.0.0"}} and bad == ["bogus line"]
    assert npu_parse.parse_hccn_ip("ipaddr:10.0.0.11\nnetmask:255.255.255.0\n") == ("10.0.0.11", "255.255.255.0")
    assert npu_parse.parse_mtu("mtu:8192") == 8192 and npu_parse.parse_mtu("mtu 1500") == 1500
    assert npu_parse.parse_mtu("error") is None
    links = npu_parse.parse_ip_link((FIX / "healthy" / "ip_link.txt").read_text())
    assert links == {"enp189s0f0": (1500, True)}
    assert npu_parse.parse_cann_version((FIX / "healthy" / "toolkit_install.info").read_text()) == "9.0.0"
    assert npu_parse.parse_cann_version((FIX / "cann_wrong" / "version.cfg").read_text()) == "8.0.0"
    assert npu_parse.parse_cann_version("toolkit_running_version=[8.3.RC2]") == "8.3.RC2"
    assert npu_parse.cann_release_matches("8.3.rc1", "8.3.RC1")
    assert not npu_parse.cann_release_matches("8.0.0", "9.0.0")


def test_pins_come_from_requirements_txt(monkeypatch):
    real = pins.installed_version
    monkeypatch.setattr(pins, "installed_version", lambda name: "2.9.0" if name == "mindspore" else real(name))
    source, pinned = pins.read_pins()
    text = (REPO / "requirements.txt").read_text()
    assert source.endswith("requirements.txt")
    assert pinned["mindspore"].exact in text and f"mindspore=={pinned['mindspore'].exact}" in text
    assert set(pinned) == {
        pins.normalize(ln.split("==")[0]) for ln in text.splitlines() if ln.strip() and not ln.startswith("#")
    }
    assert pins.satisfies("3.11.4", ">=3.9,<3.12") and not pins.satisfies("3.12.0", ">=3.9,<3.12")
    # the pinned MindSpore has a known CANN pairing (doctor:cann and the Dockerfile rely on it)
    assert pinned["mindspore"].exact in pins.MINDSPORE_CANN


@pytest.mark.parametrize("found, line", [("2.9.0", "2.9"), ("2.10.0", "2.10")])
def test_doctor_reports_the_mindspore_line_against_that_lines_pins(monkeypatch, found, line):
    real = pins.installed_version
    monkeypatch.setattr(pins, "installed_version", lambda name: found if name == "mindspore" else real(name))
    res = run_check(REGISTRY["mindspore"], DoctorContext(probe=RecordedProbe()))
    assert res.status == PASS, res.message
    assert res.message == f"mindspore {found} matches =={found}; MindSpore line {line} (supported: 2.9, 2.10)"


def test_doctor_fails_an_untested_mindspore_line_in_one_line(monkeypatch):
    real = pins.installed_version
    monkeypatch.setattr(pins, "installed_version", lambda name: "2.11.0" if name == "mindspore" else real(name))
    res = run_check(REGISTRY["mindspore"], DoctorContext(probe=RecordedProbe()))
    assert res.status == FAIL and res.message.startswith("MindSpore 2.11.0: ms-deepseek runs on MindSpore 2.9.x and")
    assert "\n" not in res.message


def test_version_specs_without_packaging(monkeypatch):
    # a bare venv has no importable `packaging`: the fallback must agree on the pins' forms
    monkeypatch.setitem(sys.modules, "packaging.specifiers", None)
    assert pins.satisfies("3.11.4", ">=3.9,<3.12") and not pins.satisfies("3.12.0", ">=3.9,<3.12")
    assert pins.satisfies("2.9.0", "==2.9.0") and not pins.satisfies("2.9.1", "==2.9.0")
    assert pins.satisfies("1.26.4", "") and not pins.satisfies("2.0.0", "<2")


def test_requirements_override_and_bad_lines(tmp_path):
    from ms_deepseek.core.errors import UserError

    req = tmp_path / "req.txt"
    req.write_text("numpy==0.0.1\n")
    res = run_check(REGISTRY["numpy"], DoctorContext(probe=RecordedProbe(), requirements=str(req)))
    assert res.status == FAIL and "0.0.1" in res.message and "pip install" in res.fix
    res = run_check(REGISTRY["packages"], DoctorContext(probe=RecordedProbe(), requirements=str(tmp_path / "no")))
    assert res.status == FAIL and "requirements file not found" in res.message and "crashed" not in res.message
    with pytest.raises(UserError, match="not found"):
        pins.read_pins(str(tmp_path / "missing.txt"))
    with pytest.raises(UserError, match="cannot read line"):
        pins.parse_requirement_lines(["=bad"])


# ------------------------------------------------------------------------------- verdicts on recorded hosts

HEALTHY_NPU_CHECKS = [
    "cann",
    "npu_devices",
    "npu_health",
    "npu_memory",
    "npu_ecc",
    "swappiness",
    "disk_space",
    "device_count",
    "hccn_conf",
    "nic_mtu",
    "hccl_timeouts",
]


@pytest.mark.parametrize("check_id", HEALTHY_NPU_CHECKS)
def test_healthy_node_passes(check_id):
    res = verdict("healthy", check_id)
    assert res.status == PASS, res


@pytest.mark.parametrize(
    "case, check_id, status, words",
    [
        ("hccn_mismatch", "hccn_conf", FAIL, ["device_id 2", "192.168.1.16", "device_id 5", "192.168.1.13"]),
        ("mtu_1500", "nic_mtu", WARN, ["1500"]),
        ("ecc_errors", "npu_ecc", FAIL, ["NPU 3", "Double Bit Error Count=2"]),
        ("swappiness_60", "swappiness", WARN, ["60"]),
        ("cann_missing", "cann", FAIL, ["CANN toolkit not found"]),
        ("cann_wrong", "cann", FAIL, ["CANN 8.0.0", "needs CANN 9.0.0"]),
        ("npu_unhealthy", "npu_health", FAIL, ["NPU 2: Alarm", "NPU 6: Warning"]),
        ("npu_unhealthy", "device_count", FAIL, ["NPU 2: Alarm"]),
    ],
)
def test_broken_host_verdicts(case, check_id, status, words):
    res = verdict(case, check_id)
    assert res.status == status, res
    for w in words:
        assert w in res.message, (w, res.message)
    assert res.fix  # every warning / failure says what to do
    # ... and the broken input breaks only its own checks
    broken = {check_id} | ({"npu_health", "device_count"} if case == "npu_unhealthy" else set())
    for other in HEALTHY_NPU_CHECKS:
        if other not in broken:
            assert verdict(case, other).status == PASS, (case, other, verdict(case, other))


def test_mtu_1500_fails_for_a_cluster():
    assert verdict("mtu_1500", "nic_mtu", level=16).status == FAIL


def test_mixed_mtu_and_missing_hccn_entries():
    p = probe("healthy")
    p.commands["hccn_tool -i 4 -mtu -g"] = CommandResult(0, "mtu:1500\n")
    res = run_check(REGISTRY["nic_mtu"], DoctorContext(probe=p, level=8))
    assert res.status == FAIL and "differ" in res.message and "4:1500" in res.message
    p.files["/etc/hccn.conf"] = (
        "\n".join(ln for ln in p.files["/etc/hccn.conf"].splitlines() if not ln.startswith("address_7"))
        + "\naddress_9=192.168.1.99\n"
    )
    res = run_check(REGISTRY["hccn_conf"], DoctorContext(probe=p, level=8))
    assert res.status == FAIL and "address_7 missing" in res.message and "[9]" in res.message


def test_hbm_taken_by_another_process():
    p = probe("healthy")
    p.commands["npu-smi info"] = CommandResult(
        0, p.commands["npu-smi info"].stdout.replace("3304 / 65536", "41697/ 65536")
    )
    res = run_check(REGISTRY["npu_memory"], DoctorContext(probe=p))
    assert res.status == WARN and "NPU 4: 40.7 of 64 GB" in res.message and "npu-smi" in res.fix


def test_hccl_timeout_values():
    def res(**env):
        p = probe("healthy")
        for k, v in env.items():
            if v is None:
                p.environ.pop(k, None)
            else:
                p.environ[k] = v
        return run_check(REGISTRY["hccl_timeouts"], DoctorContext(probe=p, level=8))

    assert res().status == PASS
    assert res(HCCL_CONNECT_TIMEOUT=None).status == WARN
    assert res(HCCL_CONNECT_TIMEOUT="abc").status == FAIL
    assert res(HCCL_CONNECT_TIMEOUT="60").status == FAIL  # below the allowed 120
    assert res(HCCL_CONNECT_TIMEOUT="300").status == WARN
    assert res(HCCL_EXEC_TIMEOUT="0").status == WARN
    assert res(HCCL_EXEC_TIMEOUT="-5").status == FAIL


def test_no_npu_host_skips_npu_checks_and_runs_the_rest():
    ctx = ctx_for("no_npu", level=8)
    results = {c.id: run_check(c, ctx) for c in checks_for_level(8) if not c.heavy}
    for cid in ("cann", "npu_devices", "npu_health", "npu_memory", "npu_ecc", "device_count", "hccn_conf", "nic_mtu"):
        assert results[cid].status == SKIP and results[cid].message.startswith("skipped: no NPU"), results[cid]
    assert "enp189s0f0 mtu 1500" in results["nic_mtu"].message
    assert results["swappiness"].status == PASS and results["disk_space"].status == PASS
    assert results["hccl_timeouts"].status == WARN  # runs for real: the variables are unset here


def test_disk_space_thresholds():
    p = probe("healthy")
    p.disk = {"/": 5 * 1024**3}
    assert run_check(REGISTRY["disk_space"], DoctorContext(probe=p)).status == WARN
    assert run_check(REGISTRY["disk_space"], DoctorContext(probe=p, need_gb=10)).status == FAIL
    p.disk = {"/": 512 * 1024**2}
    assert run_check(REGISTRY["disk_space"], DoctorContext(probe=p)).status == FAIL


def test_collective_results_verdicts():
    good = {
        "ok": True,
        "world": 8,
        "device": "Ascend",
        "bytes": 64 << 20,
        "seconds": 0.0007,
        "algbw_gbps": 171.4,
        "busbw_gbps": 300.0,
    }
    ctx = ctx_for("healthy", level=8)
    ctx.cache["bench:node"] = good
    res = run_check(REGISTRY["allreduce_bw"], ctx)
    assert res.status == PASS and "42.9 GB/s per peer" in res.message
    ctx = ctx_for("healthy", level=8)
    ctx.cache["bench:node"] = dict(good, busbw_gbps=100.0)  # 14 GB/s per peer
    assert run_check(REGISTRY["allreduce_bw"], ctx).status == WARN
    ctx = ctx_for("healthy", level=8)
    ctx.cache["bench:node"] = {"ok": False, "error": "timed out"}
    res = run_check(REGISTRY["allreduce_bw"], ctx)
    assert res.status == FAIL and "timed out" in res.message

    same = "python=3.11.4 mindspore=2.9.0 numpy=1.26.4 ms-deepseek=0.1.0 cann=9.0.0"
    ranks = {str(r): {"host": f"node{r // 8}", "versions": same} for r in range(16)}
    cluster = dict(good, world=16, busbw_gbps=21.0, ranks=ranks)
    ctx = ctx_for("healthy", level=16, master_addr="10.0.0.1")
    ctx.cache["bench:cluster"] = cluster
    assert run_check(REGISTRY["version_consistency"], ctx).status == PASS
    assert run_check(REGISTRY["cross_node_bw"], ctx).status == PASS
    ranks2 = dict(
        ranks, **{str(r): {"host": "node1", "versions": same.replace("cann=9.0.0", "cann=8.5.0")} for r in range(8, 16)}
    )
    ranks2["0"] = dict(ranks["0"])
    ctx = ctx_for("healthy", level=16, master_addr="10.0.0.1")
    ctx.cache["bench:cluster"] = dict(
        cluster, ranks=dict(ranks2, **{str(r): ranks[str(r)] for r in range(1, 9)}), busbw_gbps=5.0
    )
    res = run_check(REGISTRY["version_consistency"], ctx)
    assert res.status == FAIL and "node1" in res.message and "cann=8.5.0" in res.message
    assert run_check(REGISTRY["cross_node_bw"], ctx).status == WARN


def test_master_reachable():
    p = probe("healthy")
    assert run_check(REGISTRY["master_reachable"], DoctorContext(probe=p, level=16)).status == FAIL
    p.tcp = {"10.0.0.1:8118": "refused"}
    assert (
        run_check(REGISTRY["master_reachable"], DoctorContext(probe=p, level=16, master_addr="10.0.0.1")).status == PASS
    )
    p.tcp = {"10.0.0.1:8118": "timeout"}
    res = run_check(REGISTRY["master_reachable"], DoctorContext(probe=p, level=16, master_addr="10.0.0.1"))
    assert res.status == FAIL and "timeout" in res.message
    p.addresses = ["10.0.0.1"]
    assert (
        run_check(REGISTRY["master_reachable"], DoctorContext(probe=p, level=16, master_addr="10.0.0.1")).status == PASS
    )


def test_smoke_verdicts_from_recorded_output():
    out = 'noise\n{"device": "CPU", "mode": "graph", "steps": 3, "losses": [5.5, 4.0, 2.0], "seconds": 3.0}\n'
    assert smoke_verdict(parse_smoke_output(out)).status == PASS
    assert smoke_verdict({"losses": [5.5, 5.6, 5.5]}).status == FAIL
    assert smoke_verdict({"losses": [5.5, float("nan")]}).status == FAIL
    p = probe("healthy")
    p.commands["python -m ms_deepseek.doctor.smoke --steps 10 --json"] = CommandResult(
        1, '{"error": "ImportError: cannot import name DeepseekV2ForCausalLM"}\n'
    )
    res = run_check(REGISTRY["smoke_train"], DoctorContext(probe=p))
    assert res.status == FAIL and "ImportError" in res.message


def test_crashing_check_is_a_failure_not_a_traceback():
    class Broken(RecordedProbe):
        def read_file(self, path):
            raise RuntimeError("boom")

    res = run_check(REGISTRY["swappiness"], DoctorContext(probe=Broken()))
    assert res.status == FAIL and "boom" in res.message


def test_runner_output_json_and_exit_code():
    ctx = ctx_for("ecc_errors", level=8)
    checks = [c for c in select_checks(8, None) if not c.heavy]
    lines = []
    results = run_doctor(ctx, checks, echo=lines.append)
    assert exit_code(results) == 1
    assert any(ln.startswith("[FAIL] npu_ecc") and "-> fix:" in ln for ln in lines)
    doc = to_json(ctx, results)
    assert doc["ok"] is False and doc["counts"][FAIL] == 1
    assert {c["id"] for c in doc["checks"]} == {c.id for c in checks}
    json.dumps(doc)
    assert exit_code(run_doctor(ctx_for("swappiness_60", level=8), checks)) == 0  # warnings do not fail


def test_levels_and_ids():
    ids1 = {c.id for c in checks_for_level(1)}
    ids8 = {c.id for c in checks_for_level(8)}
    ids16 = {c.id for c in checks_for_level(16)}
    assert ids1 < ids8 < ids16 and {c.id for c in checks_for_level(64)} == ids16
    assert {"smoke_train", "swappiness", "cann", "npu_ecc"} <= ids1
    assert {"hccn_conf", "nic_mtu", "hccl_timeouts", "allreduce_bw"} <= ids8 - ids1
    assert {"master_reachable", "version_consistency", "cross_node_bw"} <= ids16 - ids8
    order = [c.id for c in checks_for_level(16)]
    assert order.index("smoke_train") > order.index("master_reachable")  # heavy checks run last
    assert format_line(REGISTRY["swappiness"], CheckResult(WARN, "x", "y")) == "[WARN] swappiness           x -> fix: y"


def _cli(*args, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "ms_deepseek.cli", "doctor", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=str(REPO),
    )


def test_cli_bad_arguments():
    proc = _cli("--only", "nonsense")
    assert proc.returncode == 2 and "unknown check id" in proc.stderr and "Traceback" not in proc.stderr
    proc = _cli("--list")
    assert proc.returncode == 0 and "doctor:hccn_conf" in proc.stdout


@pytest.mark.slow
def test_doctor_level1_on_this_machine():
    """The real thing: versions, host settings and the 10-step smoke training run; exit 0."""
    proc = _cli("--level", "1", "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(proc.stdout)
    by_id = {c["id"]: c for c in doc["checks"]}
    assert by_id["mindspore"]["status"] == PASS and by_id["numpy"]["status"] == PASS
    assert by_id["smoke_train"]["status"] == PASS, by_id["smoke_train"]
    losses = by_id["smoke_train"]["details"]["losses"]
    assert len(losses) == 10 and losses[-1] < 0.95 * losses[0]
    if not Path("/dev/davinci0").exists():
        assert by_id["npu_health"]["status"] == SKIP and by_id["npu_health"]["message"] == "skipped: no NPU"


@pytest.mark.msrun
def test_level8_allreduce_over_msrun():
    """A real 2-process all-reduce through msrun (mccl on CPU): bandwidth reported as information."""
    proc = _cli("--level", "8", "--only", "allreduce_bw", "--json", "--bench-mb", "4")
    doc = json.loads(proc.stdout)
    (res,) = doc["checks"]
    assert res["status"] == PASS, res
    assert res["details"]["world"] == 2 and res["details"]["busbw_gbps"] > 0
    assert "GB/s" in res["message"]


@pytest.mark.msrun
def test_level16_two_nodes_gather_versions_over_msrun():
    """Two doctor processes play node 0 and node 1 of a level-16 check on this host (one CPU worker
    each): the versions of every rank are gathered over msrun and compared, and the all-reduce
    across the two 'nodes' reports its bandwidth."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "ms_deepseek.cli",
        "doctor",
        "--level",
        "16",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(port),
        "--bench-workers",
        "1",
        "--bench-mb",
        "1",
        "--json",
        "--only",
        "master_reachable,version_consistency,cross_node_bw",
        "--node-rank",
    ]
    procs = [
        subprocess.Popen(cmd + [str(rank)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(REPO))
        for rank in (0, 1)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    for proc, (out, err) in zip(procs, outs):
        assert proc.returncode == 0, out + err
        checks = {c["id"]: c for c in json.loads(out)["checks"]}
        assert checks["version_consistency"]["status"] == PASS
        assert "all 2 ranks run" in checks["version_consistency"]["message"]
        assert "mindspore=" in checks["version_consistency"]["message"]
        assert checks["cross_node_bw"]["status"] == PASS and checks["cross_node_bw"]["details"]["world"] == 2


def test_every_recipe_key_a_fix_names_exists():
    """Every `section.key` in the messages of the doctor's checks, the report and the training alerts is a key a
    recipe takes (not, say, checkpoint.dir or checkpoint.keep, which `train` refuses as unknown)."""
    import ast
    import dataclasses
    import re
    import typing

    from ms_deepseek.config.recipe import Recipe

    from repo_paths import REPO

    sections = {}
    for f in dataclasses.fields(Recipe):
        if f.init:
            tp = typing.get_type_hints(Recipe)[f.name]
            cls = next((a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)), tp)
            sections[f.name] = {g.name for g in dataclasses.fields(cls) if g.init}
    pattern = re.compile(r"(?<![\w./])(" + "|".join(sections) + r")\.([a-z_]+)(?![.\w{])")
    files = [
        p
        for room in ("verification", "doctor", "report", "simulation")
        for p in (REPO / "ms_deepseek" / room).rglob("*.py")
    ]
    named = []
    for path in files:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docstrings = {
            id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                named += [(path.name, node.lineno, m.group(1), m.group(2)) for m in pattern.finditer(node.value)]
    assert named, "the scan found no recipe key at all"
    unknown = [f"{name}:{line}: {section}.{key}" for name, line, section, key in named if key not in sections[section]]
    assert not unknown, unknown


def test_swappiness_is_not_a_warning_without_swap():
    from ms_deepseek.doctor import host  # noqa: F401  (registers the host checks)
    from ms_deepseek.doctor.core import PASS, REGISTRY, WARN, DoctorContext, run_check
    from ms_deepseek.doctor.probe import RecordedProbe

    def result(swap_kb):
        probe = RecordedProbe(
            files={
                "/proc/sys/vm/swappiness": "60\n",
                "/proc/meminfo": f"MemTotal: 1000 kB\nSwapTotal:       {swap_kb} kB\n",
            }
        )
        return run_check(REGISTRY["swappiness"], DoctorContext(probe=probe))

    none = result(0)
    assert none.status == PASS and "no swap" in none.message
    assert result(4 * 1024**2).status == WARN
