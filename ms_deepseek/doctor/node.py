"""Level-8 (one node) and level-16/64 (several nodes) doctor checks.

Node: all 8 devices visible and healthy, /etc/hccn.conf against the devices'
real NIC addresses, the RoCE NICs' MTU, HCCL timeout variables, and an
all-reduce bandwidth test over msrun. Cluster: the master address answers,
every rank runs the same versions (gathered over msrun) and the cross-node
all-reduce bandwidth.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional

from ms_deepseek.doctor import npu_parse
from ms_deepseek.doctor.core import (
    DEVICES_PER_NODE,
    HCCS_GBPS_PER_PEER,
    NO_NPU,
    ROCE_GBPS_PER_NPU,
    CheckResult,
    DoctorContext,
    check,
    failed,
    passed,
    skipped,
    warned,
)
from ms_deepseek.doctor.host import has_npu, npu_error, npu_state

ROCE_MIN_MTU = 4200  # carries a 4096-byte RoCE payload plus headers; below it RoCE drops to 1024-byte frames
HCCL_CONNECT_RANGE = (120, 7200)  # CANN env reference: integer seconds, default 120
HCCL_CONNECT_RECOMMENDED = 1800  # graph compilation of a large model can keep ranks apart for many minutes
HCCL_EXEC_DEFAULT = 1836


# ---------------------------------------------------------------------------------------------
# level 8: one node


@check("device_count", 8, "all 8 NPUs of the node visible and healthy")
def check_device_count(ctx: DoctorContext) -> CheckResult:
    bad = npu_error(ctx)
    if bad:
        return bad
    devices = npu_state(ctx)[2]
    ids = sorted(d.npu_id for d in devices)
    sick = [f"NPU {d.npu_id}: {d.health}" for d in devices if d.health.upper() != "OK"]
    if len(devices) != DEVICES_PER_NODE:
        missing = sorted(set(range(DEVICES_PER_NODE)) - set(ids))
        return failed(
            f"{len(devices)} of {DEVICES_PER_NODE} NPUs visible (ids {ids}; missing {missing})",
            "check `npu-smi info` on the host and, in a container, pass every /dev/davinciN with --device",
        )
    if sick:
        return failed(
            "not all NPUs healthy: " + ", ".join(sick),
            "see doctor:npu_health; take the node out of the job until every device reports OK",
        )
    return passed(f"{DEVICES_PER_NODE} NPUs visible, all Health OK")


def _hccn_tool_ip(ctx: DoctorContext, dev: int) -> Optional[str]:
    result = ctx.probe.run(["hccn_tool", "-i", str(dev), "-ip", "-g"], timeout=30)
    if result is None or not result.ok:
        return None
    return npu_parse.parse_hccn_ip(result.stdout)[0]


@check("hccn_conf", 8, "/etc/hccn.conf device entries")
def check_hccn_conf(ctx: DoctorContext) -> CheckResult:
    text = ctx.probe.read_file("/etc/hccn.conf")
    if text is None:
        if not has_npu(ctx):
            return skipped(NO_NPU)
        return failed(
            "/etc/hccn.conf is missing",
            "configure the device NICs: for i in 0..7: hccn_tool -i $i -ip -s address <ip> netmask <mask>",
        )
    entries, malformed = npu_parse.parse_hccn_conf(text)
    problems: List[str] = []
    if malformed:
        problems.append(f"unreadable lines: {malformed[:3]}")
    devices = [d.npu_id for d in npu_state(ctx)[2]] or list(range(DEVICES_PER_NODE))
    for dev in devices:
        fields = entries.get(dev, {})
        for key in ("address", "netmask"):
            if key not in fields:
                problems.append(f"{key}_{dev} missing")
    extra = sorted(set(entries) - set(devices))
    if extra:
        problems.append(f"entries for device ids {extra} that this node does not have")
    by_addr: Dict[str, List[int]] = {}
    for dev, fields in entries.items():
        if "address" in fields:
            by_addr.setdefault(fields["address"], []).append(dev)
    dup = {a: ds for a, ds in by_addr.items() if len(ds) > 1}
    for addr, ds in dup.items():
        problems.append(f"address {addr} given to devices {ds}")
    # Physical order: device N's NIC must carry address_N (a swapped pair sends HCCL to the wrong card).
    if ctx.probe.which("hccn_tool"):
        for dev in devices:
            want = entries.get(dev, {}).get("address")
            have = _hccn_tool_ip(ctx, dev)
            if want and have and want != have:
                owner = by_addr.get(have)
                hint = f" (hccn.conf gives that address to device {owner[0]})" if owner else ""
                problems.append(f"device_id {dev}: hccn.conf address_{dev}={want} but its NIC has {have}{hint}")
    if problems:
        return failed(
            "/etc/hccn.conf inconsistent: " + "; ".join(problems),
            "rewrite address_N/netmask_N so N is the device id whose NIC carries that address "
            "(`hccn_tool -i N -ip -g` shows it), or reset the NIC with `hccn_tool -i N -ip -s ...`",
        )
    return passed(
        f"/etc/hccn.conf has address/netmask for devices {devices}, all distinct"
        + (" and matching the NICs" if ctx.probe.which("hccn_tool") else "")
    )


@check("nic_mtu", 8, "RoCE NIC MTU")
def check_nic_mtu(ctx: DoctorContext) -> CheckResult:
    if not ctx.probe.which("hccn_tool"):
        hosts = ""
        link = ctx.probe.run(["ip", "-o", "link"], timeout=10)
        if link is not None and link.ok:
            nics = npu_parse.parse_ip_link(link.stdout)
            up = [f"{n} mtu {m}" for n, (m, is_up) in sorted(nics.items()) if is_up]
            hosts = f" (host NICs: {', '.join(up) or 'none up'})"
        if not has_npu(ctx):
            return skipped(NO_NPU + hosts)
        return failed(
            "hccn_tool not found: cannot read the device NICs' MTU" + hosts,
            "install the Ascend driver tools (/usr/local/Ascend/driver/tools/hccn_tool)",
        )
    devices = [d.npu_id for d in npu_state(ctx)[2]] or list(range(DEVICES_PER_NODE))
    mtus: Dict[int, Optional[int]] = {}
    for dev in devices:
        result = ctx.probe.run(["hccn_tool", "-i", str(dev), "-mtu", "-g"], timeout=30)
        mtus[dev] = npu_parse.parse_mtu(result.stdout) if result is not None and result.ok else None
    unread = [d for d, m in mtus.items() if m is None]
    values = sorted({m for m in mtus.values() if m is not None})
    listing = ", ".join(f"{d}:{m}" for d, m in mtus.items())
    fix = (
        f"for i in 0..7: hccn_tool -i $i -mtu -s size {ROCE_MIN_MTU} (or more; the same value on every NIC "
        "and switch port)"
    )
    if unread:
        return warned(f"could not read the MTU of device(s) {unread}", "run `hccn_tool -i N -mtu -g` by hand")
    if len(values) > 1:
        return failed(f"device NIC MTUs differ ({listing})", fix)
    mtu = values[0]
    if mtu < ROCE_MIN_MTU:
        msg = (
            f"device NIC MTU is {mtu} on all {len(devices)} NICs: RoCE runs with small frames and "
            "cross-node bandwidth drops"
        )
        return failed(msg, fix) if ctx.level >= 16 else warned(msg, fix)
    return passed(f"device NIC MTU {mtu} on all {len(devices)} NICs")


def _timeout_value(ctx: DoctorContext, name: str):
    raw = ctx.probe.env(name)
    if raw is None or raw.strip() == "":
        return None, None
    try:
        return raw, float(raw)
    except ValueError:
        return raw, "bad"


@check("hccl_timeouts", 8, "HCCL_CONNECT_TIMEOUT / HCCL_EXEC_TIMEOUT")
def check_hccl_timeouts(ctx: DoctorContext) -> CheckResult:
    errors, warnings, notes = [], [], []
    raw, value = _timeout_value(ctx, "HCCL_CONNECT_TIMEOUT")
    lo, hi = HCCL_CONNECT_RANGE
    if value is None:
        warnings.append(
            f"HCCL_CONNECT_TIMEOUT unset (default {lo} s: ranks that finish compiling minutes "
            "apart fail at communicator init)"
        )
    elif value == "bad" or not float(value).is_integer():
        errors.append(f"HCCL_CONNECT_TIMEOUT={raw!r} is not an integer number of seconds")
    elif not lo <= value <= hi:
        errors.append(f"HCCL_CONNECT_TIMEOUT={raw} outside the allowed [{lo}, {hi}]")
    elif value < 600:
        warnings.append(f"HCCL_CONNECT_TIMEOUT={raw} s is short for compiling a large model")
    else:
        notes.append(f"HCCL_CONNECT_TIMEOUT={raw}")
    raw, value = _timeout_value(ctx, "HCCL_EXEC_TIMEOUT")
    if value is None:
        notes.append(f"HCCL_EXEC_TIMEOUT unset (default {HCCL_EXEC_DEFAULT} s)")
    elif value == "bad" or value < 0:
        errors.append(f"HCCL_EXEC_TIMEOUT={raw!r} is not a number of seconds >= 0")
    elif value == 0:
        warnings.append("HCCL_EXEC_TIMEOUT=0 disables the timeout: a hung collective never fails")
    elif value < 600:
        warnings.append(f"HCCL_EXEC_TIMEOUT={raw} s: a rank that saves a checkpoint while others wait can exceed it")
    else:
        notes.append(f"HCCL_EXEC_TIMEOUT={raw}")
    fix = f"export HCCL_CONNECT_TIMEOUT={HCCL_CONNECT_RECOMMENDED} HCCL_EXEC_TIMEOUT=3600 (the Docker image sets both)"
    if errors:
        return failed("; ".join(errors + warnings), fix)
    if warnings:
        return warned("; ".join(warnings + notes), fix)
    return passed("; ".join(notes))


# ---------------------------------------------------------------------------------------------
# msrun collective job (shared by allreduce_bw, version_consistency and cross_node_bw)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_collective_job(ctx: DoctorContext, scope: str) -> dict:
    """Run collective_bench.py under msrun; ``scope`` 'node' (this node only) or 'cluster'.

    Returns the bench result of this node's lowest rank, or {"ok": False, "error": ...}.
    Memoised in ``ctx.cache["bench:<scope>"]``: tests put recorded job results there.
    """

    def compute():
        npu = has_npu(ctx) and npu_state(ctx)[0] == "ok"
        local = ctx.bench_workers or (len(npu_state(ctx)[2]) if npu else 2)
        if scope == "node":
            world, addr, port, node_rank = local, "127.0.0.1", _free_port(), 0
        else:
            addr = ctx.master_addr or ctx.probe.env("MS_SCHED_HOST")
            if not addr:
                return {"ok": False, "error": "no master address (--master-addr or MS_SCHED_HOST)"}
            world, port = local * ctx.nodes, ctx.master_port
            node_rank = ctx.node_rank if ctx.node_rank is not None else 0
        repo = str(Path(__file__).resolve().parents[2])
        env = {
            "PATH": os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]),
            "PYTHONPATH": os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH", "")) if p),
            "GLOG_v": os.environ.get("GLOG_v", "3"),
        }
        with tempfile.TemporaryDirectory(prefix="ms_deepseek_bench_") as tmp:
            out, logs = Path(tmp) / "out", Path(tmp) / "logs"
            msrun = [
                f"--worker_num={world}",
                f"--local_worker_num={local}",
                f"--master_addr={addr}",
                f"--master_port={port}",
                f"--node_rank={node_rank}",
                f"--log_dir={logs}",
            ]
            result = ctx.probe.run(_bench_argv(ctx, npu, msrun, out), timeout=ctx.timeout, env=env, cwd=tmp)
            return _bench_result(result, out, logs, local)

    return ctx.memo(f"bench:{scope}", compute)


def _bench_argv(ctx: DoctorContext, npu: bool, msrun: List[str], out: Path) -> List[str]:
    """msrun (its module form) with the job's ``msrun`` options, running collective_bench.py into ``out``."""
    mb = ctx.bench_mb if npu else min(ctx.bench_mb, 8.0)
    script = Path(__file__).with_name("collective_bench.py")
    return (
        [sys.executable, "-m", "mindspore.parallel.cluster.run"]
        + msrun
        + ["--join=True", f"--cluster_time_out={int(min(ctx.timeout, 600))}", str(script)]
        + ["--out", str(out), "--device", "Ascend" if npu else "CPU", "--mb", str(mb), "--iters", "20" if npu else "5"]
    )


def _bench_result(result, out: Path, logs: Path, local: int) -> dict:
    """The lowest rank's result file, else why there is none (msrun's exit, a worker log's last error line)."""
    files = sorted(out.glob("result_rank*.json"), key=lambda p: int(p.stem.split("rank")[1])) if out.exists() else []
    if files:
        data = json.loads(files[0].read_text())
        data["local_workers"] = local
        return data
    reason = (
        "msrun did not start"
        if result is None
        else ("timed out" if result.returncode == 124 else f"msrun exit code {result.returncode}")
    )
    for log in sorted(logs.glob("worker_*.log")) if logs.exists() else []:
        errs = [ln for ln in log.read_text(errors="replace").splitlines() if "Error" in ln or "error" in ln.lower()]
        if errs:
            reason += f"; {log.name}: {errs[-1].strip()[:200]}"
            break
    return {"ok": False, "error": reason}


def _bw_text(res: dict) -> str:
    return (
        f"AllReduce {res['bytes'] / 2**20:.0f} MiB over {res['world']} {res['device']} ranks: "
        f"{res['seconds'] * 1e3:.1f} ms, algbw {res['algbw_gbps']:.2f} GB/s, busbw {res['busbw_gbps']:.2f} GB/s"
    )


@check("allreduce_bw", 8, "all-reduce bandwidth inside the node (msrun)", heavy=True)
def check_allreduce_bw(ctx: DoctorContext) -> CheckResult:
    res = run_collective_job(ctx, "node")
    if not res.get("ok"):
        return failed(
            f"all-reduce test failed: {res.get('error', 'wrong result')}",
            "run `msrun --worker_num=8 --local_worker_num=8 ms_deepseek/doctor/collective_bench.py "
            "--out /tmp/bench --device Ascend` and read its worker logs; see doctor:hccl_timeouts",
        )
    text = _bw_text(res)
    if res["device"] != "Ascend":
        return passed(text + " (CPU/mccl: informational, no HCCS target)", **_public(res))
    # HCCL's mesh algorithm spreads the bus traffic over the n-1 HCCS links of each NPU.
    per_peer = res["busbw_gbps"] / max(1, res["world"] - 1)
    text += f", {per_peer:.1f} GB/s per peer (HCCS: {HCCS_GBPS_PER_PEER:.0f} GB/s per peer)"
    if per_peer < 0.5 * HCCS_GBPS_PER_PEER:
        return warned(
            text,
            "check `npu-smi info -t topo` (all pairs HCCS), that no other job shares the "
            "devices, and CPU/NUMA binding (msrun --bind_core=True)",
            **_public(res),
        )
    return passed(text, **_public(res))


def _public(res: dict) -> dict:
    return {k: res[k] for k in ("world", "device", "bytes", "seconds", "algbw_gbps", "busbw_gbps") if k in res}


# ---------------------------------------------------------------------------------------------
# level 16 / 64: several nodes


@check("master_reachable", 16, "master address reachable")
def check_master_reachable(ctx: DoctorContext) -> CheckResult:
    addr = ctx.master_addr or ctx.probe.env("MS_SCHED_HOST")
    if not addr:
        return failed(
            f"level {ctx.level} needs the master node's address",
            "pass --master-addr <node 0 IP> --node-rank <this node's rank> (same on every node)",
        )
    if addr in ctx.probe.local_addresses():
        return passed(f"this node is the master ({addr})")
    state = ctx.probe.tcp_probe(addr, ctx.master_port)
    if state in ("open", "refused"):  # a refused connection is an answer from the host
        return passed(f"master {addr} answers on the network (port {ctx.master_port}: {state})")
    return failed(
        f"master {addr}:{ctx.master_port} not reachable ({state})",
        "check the address, routes and firewall between the nodes (`ping`, `ip route get <addr>`); "
        "the master port must be open for msrun's scheduler",
    )


@check("version_consistency", 16, "identical versions on every node (msrun)", heavy=True)
def check_version_consistency(ctx: DoctorContext) -> CheckResult:
    res = run_collective_job(ctx, "cluster")
    if not res.get("ranks"):
        return failed(
            f"could not gather versions: {res.get('error', 'no result')}",
            "run the same doctor command on every node at the same time; see doctor:master_reachable",
        )
    groups: Dict[str, List[str]] = {}
    for rank, info in sorted(res["ranks"].items(), key=lambda kv: int(kv[0])):
        groups.setdefault(info["versions"], []).append(f"{info['host']}/{rank}")
    if len(groups) == 1:
        (versions,) = groups
        return passed(f"all {res['world']} ranks run {versions}")
    common = max(groups, key=lambda v: len(groups[v]))
    odd = [
        f"{', '.join(sorted(set(r.split('/')[0] for r in ranks)))}: {v}" for v, ranks in groups.items() if v != common
    ]
    return failed(
        f"versions differ from the majority ({common}): " + "; ".join(odd),
        "deploy the same image (or pip install -r requirements.txt and the same CANN) on every node",
    )


@check("cross_node_bw", 16, "all-reduce bandwidth across nodes (msrun)", heavy=True)
def check_cross_node_bw(ctx: DoctorContext) -> CheckResult:
    res = run_collective_job(ctx, "cluster")
    if not res.get("ok"):
        return failed(
            f"cross-node all-reduce failed: {res.get('error', 'wrong result')}",
            "check doctor:hccn_conf, doctor:nic_mtu and doctor:hccl_timeouts on every node",
        )
    text = _bw_text(res) + f" across {ctx.nodes} nodes"
    if res["device"] != "Ascend":
        return passed(text + " (CPU/mccl: informational, no RoCE target)", **_public(res))
    # Across nodes each NPU's RoCE NIC is the narrow link: busbw approaches its line rate.
    text += f" (RoCE: ~{ROCE_GBPS_PER_NPU:.0f} GB/s per NPU)"
    if res["busbw_gbps"] < 0.5 * ROCE_GBPS_PER_NPU:
        return warned(
            text,
            "check NIC MTU (doctor:nic_mtu), switch PFC/ECN settings and link speed (`hccn_tool -i N -speed -g`)",
            **_public(res),
        )
    return passed(text, **_public(res))
