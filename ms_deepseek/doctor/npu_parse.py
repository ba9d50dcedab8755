"""Parsers for the text that Ascend tools and config files print.

Pure functions (text in, data out) so each format is tested against recorded
outputs: ``npu-smi info`` (the device table), ``npu-smi info -t ecc -i N``,
``/etc/hccn.conf``, ``hccn_tool -i N -ip -g`` / ``-mtu -g``, ``ip -o link``,
the CANN toolkit's ``ascend_toolkit_install.info`` / ``version.cfg``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple


@dataclass
class NpuDevice:
    npu_id: int
    name: str
    health: str
    chip: Optional[int] = None
    bus_id: Optional[str] = None
    hbm_used_mb: Optional[int] = None
    hbm_total_mb: Optional[int] = None


def parse_npu_smi_info(text: str) -> Tuple[Optional[str], List[NpuDevice]]:
    """(driver version from the header, devices) from ``npu-smi info``.

    Each device takes two table rows::

        | 0     910B3               | OK            | 94.3        53                0    / 0             |
        | 0                         | 0000:C1:00.0  | 0           0    / 0          4487 / 65536         |

    Parsing stops at the process table that follows the device table.
    """
    version = None
    m = re.search(r"Version:\s*([0-9A-Za-z.\-]+)", text)
    if m:
        version = m.group(1)
    devices: List[NpuDevice] = []
    current: Optional[NpuDevice] = None
    for line in text.splitlines():
        if "Process id" in line or "Process name" in line or "No running processes" in line:
            break
        if not line.startswith("|"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3:
            continue
        first, second, third = cells[0], cells[1], cells[2]
        head = re.match(r"^(\d+)\s+(\S.*)$", first)
        if head and not head.group(2).strip().isdigit() and re.match(r"^[A-Za-z]", second):
            current = NpuDevice(int(head.group(1)), head.group(2).strip(), second.split()[0])
            devices.append(current)
            continue
        if current is not None and first.isdigit() and re.match(r"^[0-9A-Fa-f]{4}:[0-9A-Fa-f]{2}:", second):
            current.chip = int(first)
            current.bus_id = second
            hbm = re.findall(r"(\d+)\s*/\s*(\d+)", third)
            if hbm:
                used, total = hbm[-1]  # the last "used / total" pair is HBM
                current.hbm_used_mb, current.hbm_total_mb = int(used), int(total)
            current = None
    return version, devices


def parse_colon_fields(text: str) -> Dict[str, str]:
    """``Key : value`` lines (npu-smi's detail views) -> {key: value}."""
    fields = {}
    for line in text.splitlines():
        if ":" in line:
            key, _, value = line.partition(":")
            key = key.strip()
            if key:
                fields[key] = value.strip()
    return fields


def parse_ecc(text: str) -> Dict[str, int]:
    """Integer counters from ``npu-smi info -t ecc -i N`` (non-numeric fields dropped)."""
    counts = {}
    for key, value in parse_colon_fields(text).items():
        if re.fullmatch(r"-?\d+", value) and key not in ("NPU ID", "Chip ID"):
            counts[key] = int(value)
    return counts


def ecc_verdict(counts: Dict[str, int]) -> Tuple[Dict[str, int], Dict[str, int]]:
    """(uncorrectable, corrected) non-zero counters: double-bit errors and isolated pages are
    uncorrectable; single-bit errors were corrected by ECC but mark a degrading HBM."""
    bad, soft = {}, {}
    for key, value in counts.items():
        if value <= 0:
            continue
        low = key.lower()
        if "double" in low or "multi" in low or ("isolated" in low and "next" not in low and "single" not in low):
            bad[key] = value
        elif "single" in low or "error" in low or "err" in low:
            soft[key] = value
    return bad, soft


def parse_hccn_conf(text: str) -> Tuple[Dict[int, Dict[str, str]], List[str]]:
    """({device_id: {field: value}}, malformed lines) from /etc/hccn.conf.

    Lines look like ``address_0=192.168.100.101`` / ``netmask_0=255.255.255.0``:
    the trailing ``_<n>`` is the device id.
    """
    devices: Dict[int, Dict[str, str]] = {}
    bad: List[str] = []
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z][A-Za-z_]*?)_(\d+)\s*=\s*(.*)", line)
        if not m:
            bad.append(raw.strip())
            continue
        devices.setdefault(int(m.group(2)), {})[m.group(1)] = m.group(3).strip()
    return devices, bad


def parse_hccn_ip(text: str) -> Tuple[Optional[str], Optional[str]]:
    """(ipaddr, netmask) from ``hccn_tool -i N -ip -g``."""
    ip = re.search(r"ipaddr\s*[:=]\s*([0-9.]+)", text)
    mask = re.search(r"netmask\s*[:=]\s*([0-9.]+)", text)
    return (ip.group(1) if ip else None), (mask.group(1) if mask else None)


def parse_mtu(text: str) -> Optional[int]:
    """MTU from ``hccn_tool -i N -mtu -g`` (``mtu:8192`` or ``mtu 8192``)."""
    m = re.search(r"mtu\s*[:=]?\s*(\d+)", text, re.IGNORECASE)
    return int(m.group(1)) if m else None


def parse_ip_link(text: str) -> Dict[str, Tuple[int, bool]]:
    """{interface: (mtu, is_up)} from ``ip -o link`` (loopback left out)."""
    result = {}
    for line in text.splitlines():
        m = re.match(r"^\d+:\s*([^:@\s]+)(?:@\S+)?:\s*<([^>]*)>.*?\bmtu\s+(\d+)", line)
        if not m or m.group(1) == "lo":
            continue
        flags = m.group(2).split(",")
        result[m.group(1)] = (int(m.group(3)), "UP" in flags and "LOWER_UP" in flags)
    return result


def parse_cann_version(text: str) -> Optional[str]:
    """CANN release from ``ascend_toolkit_install.info`` (``version=9.0.0``) or ``version.cfg``
    (``toolkit_running_version=[7.6.0.1.220:8.0.0]``: the part after the colon is the release)."""
    m = re.search(r"^\s*version\s*=\s*(\S+)\s*$", text, re.MULTILINE)
    if m:
        return m.group(1)
    m = re.search(r"^\s*(?:toolkit|runtime)_running_version\s*=\s*\[([^\]]+)\]", text, re.MULTILINE)
    if m:
        return m.group(1).split(":")[-1].strip()
    return None


def cann_release_matches(found: str, wanted: str) -> bool:
    """Same CANN release: '9.0.0' == '9.0.0', '8.3.RC1' == '8.3.rc1'; '9.0.0' != '9.0.0.beta1'
    would be too strict for hotfix builds, so extra trailing parts after a full match are accepted."""
    f, w = found.lower().split("."), wanted.lower().split(".")
    return f[: len(w)] == w


def parse_version_tuple(text: str) -> Tuple[int, ...]:
    """Leading numeric parts of a version string: '25.3.rc1' -> (25, 3)."""
    parts = []
    for piece in text.split("."):
        if not piece.isdigit():
            break
        parts.append(int(piece))
    return tuple(parts)
