"""The pinned versions, read at run time from the one source of truth.

``requirements.txt`` at the repository root holds the runtime pins of the default
MindSpore line, ``requirements-ms<line>.txt`` those of each other supported line
(``core/runtime.SUPPORTED_MINDSPORE_LINES``); setup.py turns the chosen file into
``install_requires``, so an installed package carries the same pins in its metadata
(``Requires-Dist``). Lookup order: an explicit path, the checkout's file of the
installed MindSpore's line, then the installed distribution's metadata.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from ms_deepseek.core.errors import UserError
from ms_deepseek.core.safe_io import regular_file

REPO_ROOT = Path(__file__).resolve().parents[2]
DIST_NAME = "ms-deepseek"

# MindSpore release -> the CANN release it is built for (MindSpore Transformers install
# guide, "Confirming Version Matching Relationship", r1.9.0 and earlier), and the Ascend
# HDK (driver / firmware) listed beside it.
MINDSPORE_CANN = {
    "2.9.0": ("9.0.0", "26.0.RC1"),
    "2.7.2": ("8.5.0", "25.5.0"),
    "2.7.1": ("8.3.RC1", "25.3.RC1"),
    "2.7.0": ("8.2.RC1", "25.2.0"),
    "2.6.0": ("8.1.RC1", "25.0.RC1"),
    "2.4.10": ("8.0.0", "24.1.0"),
}


def normalize(name: str) -> str:
    """PEP 503 project name normalisation."""
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass
class Pin:
    name: str
    spec: str  # e.g. "==2.9.0"; "" when unpinned

    @property
    def exact(self) -> Optional[str]:
        return self.spec[2:] if self.spec.startswith("==") and "," not in self.spec else None


def parse_requirement_lines(lines: List[str]) -> Dict[str, Pin]:
    """{normalised name: Pin} from requirement strings (comments, blanks and markers dropped)."""
    pins = {}
    for raw in lines:
        line = raw.split("#", 1)[0].split(";", 1)[0].strip()
        if not line or line.startswith("-"):
            continue
        m = re.match(r"^([A-Za-z0-9][A-Za-z0-9._\-]*)(?:\[[^\]]*\])?\s*(.*)$", line)
        if not m:
            raise UserError(f"requirements: cannot read line {raw.strip()!r}")
        spec = m.group(2).replace(" ", "").strip("()")
        pins[normalize(m.group(1))] = Pin(m.group(1), spec)
    return pins


def read_pins(path: Optional[str] = None) -> Tuple[str, Dict[str, Pin]]:
    """(where the pins came from, pins). Raises UserError when no source is found."""
    if path:
        p = Path(path)
        if not p.exists():
            raise UserError(f"{path}: requirements file not found")
        regular_file(p, "requirements file")
        try:
            text = p.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise UserError(
                f"--requirements {path}: not a text requirements file (byte {exc.start} is not UTF-8)"
            ) from None
        except OSError as exc:
            raise UserError(f"--requirements {path}: cannot read ({exc.strerror or exc})") from None
        return str(p), parse_requirement_lines(text.splitlines())
    local = REPO_ROOT / local_pins_name()
    if local.is_file() and (REPO_ROOT / "setup.py").is_file():
        return str(local), parse_requirement_lines(local.read_text().splitlines())
    import importlib.metadata as md

    try:
        requires = md.requires(DIST_NAME) or []
    except md.PackageNotFoundError:
        requires = []
    runtime = [r for r in requires if "extra ==" not in r]
    if runtime:
        return f"{DIST_NAME} package metadata", parse_requirement_lines(runtime)
    raise UserError(
        "requirements.txt not found next to the package and ms-deepseek is not installed; pass --requirements PATH"
    )


def local_pins_name() -> str:
    """The checkout's pins file for the installed MindSpore's line (requirements.txt when MindSpore is missing or
    of no supported line: its checks then say what to install)."""
    from ms_deepseek.core.runtime import SUPPORTED_MINDSPORE_LINES, mindspore_line, pins_file

    found = installed_version("mindspore")
    line = mindspore_line(found) if found else ""
    return pins_file(line) if line in SUPPORTED_MINDSPORE_LINES else "requirements.txt"


def python_requires() -> Optional[str]:
    """setup.py's ``python_requires`` (checkout) or the installed metadata's Requires-Python."""
    setup = REPO_ROOT / "setup.py"
    if setup.is_file():
        m = re.search(r"python_requires\s*=\s*[\"']([^\"']+)[\"']", setup.read_text())
        if m:
            return m.group(1)
    import importlib.metadata as md

    try:
        return md.metadata(DIST_NAME).get("Requires-Python")
    except md.PackageNotFoundError:
        return None


def installed_version(name: str) -> Optional[str]:
    import importlib.metadata as md

    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def satisfies(version: str, spec: str) -> bool:
    """``version`` meets ``spec`` (e.g. '>=3.9,<3.12' or '==2.9.0')."""
    if not spec:
        return True
    try:
        from packaging.specifiers import SpecifierSet
        from packaging.version import Version

        return Version(version) in SpecifierSet(spec)
    except ImportError:  # pragma: no cover - packaging ships with pip's environments
        pass
    v = _num(version)
    for clause in spec.split(","):
        m = re.match(r"(==|>=|<=|>|<|!=|~=)(.+)", clause.strip())
        if not m:
            return False
        op, other = m.group(1), _num(m.group(2))
        ok = {
            "==": v == other,
            ">=": v >= other,
            "<=": v <= other,
            ">": v > other,
            "<": v < other,
            "!=": v != other,
            "~=": v >= other,
        }[op]
        if not ok:
            return False
    return True


def _num(text: str) -> Tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text)[:4])
