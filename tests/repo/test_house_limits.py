"""The package's rooms stay small enough to read: no module over 600 lines, no folder whose own modules (its
sub-packages counted apart) pass 4,000 lines or 16 modules. ARCHITECTURE.md lists the rooms."""

from __future__ import annotations

from pathlib import Path
from typing import List

from repo_paths import REPO

MAX_MODULE_LINES = 600
MAX_FOLDER_LINES = 4000
MAX_FOLDER_MODULES = 16


def _lines(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


def oversized(package: Path) -> List[str]:
    """One line per module or folder of ``package`` past its limit."""
    found = []
    for folder in sorted({p.parent for p in package.rglob("*.py")}):
        modules = sorted(folder.glob("*.py"))
        lines = {m: _lines(m) for m in modules}
        for module, n in lines.items():
            if n > MAX_MODULE_LINES:
                found.append(f"{module.relative_to(package.parent)}: {n} lines (limit {MAX_MODULE_LINES})")
        total = sum(lines.values())
        if total > MAX_FOLDER_LINES or len(modules) > MAX_FOLDER_MODULES:
            found.append(
                f"{folder.relative_to(package.parent)}/: {len(modules)} modules, {total} lines "
                f"(limits {MAX_FOLDER_MODULES} modules, {MAX_FOLDER_LINES} lines)"
            )
    return found


def test_no_module_or_folder_past_its_limit():
    package = REPO / "ms_deepseek"
    assert len(list(package.rglob("*.py"))) > 100, "the scan found too few modules to mean anything"
    assert oversized(package) == []


def test_a_planted_long_module_and_crowded_folder_fail(tmp_path):
    package = tmp_path / "pkg"
    (package / "crowded").mkdir(parents=True)
    (package / "long.py").write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    for i in range(MAX_FOLDER_MODULES + 1):
        (package / "crowded" / f"m{i}.py").write_text("x = 1\n")
    (package / "heavy").mkdir()
    for i in range(7):  # each module under its limit, the folder over its own
        (package / "heavy" / f"m{i}.py").write_text("x = 1\n" * MAX_MODULE_LINES)
    (package / "sub").mkdir()
    (package / "sub" / "a.py").write_text("x = 1\n" * 300)  # under every limit
    found = sorted(oversized(package))
    assert len(found) == 3, found
    assert found[0].startswith("pkg/crowded/: 17 modules"), found
    assert found[1].startswith("pkg/heavy/: 7 modules, 4200 lines"), found
    assert found[2].startswith("pkg/long.py: 601 lines"), found
