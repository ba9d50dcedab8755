"""The package's one direction of dependency (ARCHITECTURE.md), read from the source.

Every ``import`` and ``from ... import`` of every module is collected, function-local ones
included (a local import that dodges a cycle is still a cycle), and checked:

* no module imports a module of a higher layer;
* the module graph has no cycle;
* library packages (everything but ``ms_deepseek.cli``) import no argparse;
* no module imports another module's private (``_name``) names: what other modules use has a
  public name.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Sequence, Set

import pytest

from repo_paths import REPO

PACKAGE = REPO / "ms_deepseek"

# the layers, bottom up: a module may import its own layer and those below it
LAYERS = [
    ("core",),
    ("config",),
    ("parallel_plan", "data", "ops", "report", "jobs"),
    ("checkpoint",),
    ("model", "parallel_apply"),
    ("train", "generate"),
    ("verification", "doctor", "simulation"),
    ("cli",),
]
# modules run as programs by doctor on every node (their argparse is their command line)
ARGPARSE_PROGRAMS = {"ms_deepseek.doctor.smoke", "ms_deepseek.doctor.collective_bench"}


def module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules(package: Path = PACKAGE) -> Dict[str, Path]:
    return {module_name(p, package): p for p in sorted(package.rglob("*.py"))}


def imports_of(path: Path, known: Set[str]) -> List[tuple]:
    """(line, imported module) for every ms_deepseek import in a file, resolved to a module."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            assert node.level == 0, f"{path}:{node.lineno}: relative import"
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                out.append((node.lineno, sub if sub in known else node.module))
    return out


def layer_of(module: str) -> int:
    parts = module.split(".")
    if len(parts) == 1:
        return 0  # the package root: __version__ and lazy attribute lookups only
    for index, rooms in enumerate(LAYERS, start=1):
        if parts[1] in rooms:
            return index
    raise AssertionError(f"{module}: in no layer of ARCHITECTURE.md (add its room to LAYERS)")


def upward_imports(package: Path = PACKAGE) -> List[str]:
    modules = all_modules(package)
    bad = []
    for name, path in modules.items():
        for line, target in imports_of(path, set(modules)):
            if target.split(".")[0] == "ms_deepseek" and layer_of(target) > layer_of(name):
                bad.append(
                    f"{path.relative_to(package.parent)}:{line}: {name} (layer {layer_of(name)}) imports "
                    f"{target} (layer {layer_of(target)})"
                )
    return bad


def find_cycle(package: Path = PACKAGE) -> List[str]:
    modules = all_modules(package)
    graph = {
        name: {t for _, t in imports_of(path, set(modules)) if t in modules and t != name}
        for name, path in modules.items()
    }
    state: Dict[str, int] = {}
    stack: List[str] = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return []


def private_imports(package: Path = PACKAGE) -> List[str]:
    """``from ms_deepseek.X import _name`` in a module other than X (dunder names are not private)."""
    modules = all_modules(package)
    bad = []
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if not (isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "ms_deepseek"):
                continue
            for a in node.names:
                private = a.name.startswith("_") and not (a.name.startswith("__") and a.name.endswith("__"))
                if private and node.module != name and f"{node.module}.{a.name}" not in modules:
                    bad.append(
                        f"{path.relative_to(package.parent)}:{node.lineno}: {name} imports {node.module}.{a.name}"
                    )
    return bad


def test_every_module_is_in_a_layer():
    for name in all_modules():
        layer_of(name)


def test_no_import_goes_up_a_layer():
    bad = upward_imports()
    assert not bad, "imports that go up a layer:\n" + "\n".join(bad)


def test_no_import_cycle():
    cycle = find_cycle()
    assert not cycle, "import cycle: " + " -> ".join(cycle)


def test_library_packages_import_no_argparse():
    bad = []
    for name, path in all_modules().items():
        if name.startswith("ms_deepseek.cli") or name in ARGPARSE_PROGRAMS:
            continue
        bad += [f"{name}:{line}" for line, target in imports_of(path, set()) if target == "argparse"]
    assert not bad, "argparse outside ms_deepseek.cli: " + ", ".join(bad)


@pytest.mark.parametrize(
    "planted, expected",
    [
        ("from ms_deepseek.train import trainer\n", "imports ms_deepseek.train.trainer"),
        ("def f():\n    from ms_deepseek.cli import main\n", "imports ms_deepseek.cli"),
    ],
)
def test_a_planted_upward_import_fails(tmp_path, planted, expected):
    copy = tmp_path / "ms_deepseek"
    for path in PACKAGE.rglob("*.py"):
        target = copy / path.relative_to(PACKAGE)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(path.read_text(encoding="utf-8"), encoding="utf-8")
    (copy / "config" / "planted.py").write_text(planted, encoding="utf-8")
    assert any(expected in line for line in upward_imports(copy))


def test_no_module_imports_another_modules_private_names():
    bad = private_imports()
    assert not bad, "imports of another module's private names (give them a public name):\n" + "\n".join(bad)


def mini_package(tmp_path: Path, **core_modules: str) -> Path:
    """An ms_deepseek package of a core/ room holding the given modules' sources."""
    copy = tmp_path / "ms_deepseek"
    (copy / "core").mkdir(parents=True)
    (copy / "__init__.py").write_text("")
    (copy / "core" / "__init__.py").write_text("")
    for name, source in core_modules.items():
        (copy / "core" / f"{name}.py").write_text(source)
    return copy


def test_a_planted_cycle_is_found(tmp_path):
    copy = mini_package(
        tmp_path, a="def f():\n    from ms_deepseek.core import b\n", b="from ms_deepseek.core.a import f\n"
    )
    assert find_cycle(copy) == ["ms_deepseek.core.a", "ms_deepseek.core.b", "ms_deepseek.core.a"]


def top_level_names(path: Path) -> Set[str]:
    """Names a module defines at its top level (defs, classes, assignments, imports), and '*' when it
    has a module ``__getattr__`` (then any name may exist)."""
    names: Set[str] = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add("*" if node.name == "__getattr__" else node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                names |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.If, ast.Try)):
            names |= {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
            names |= {
                (a.asname or a.name).split(".")[0]
                for n in ast.walk(node)
                if isinstance(n, (ast.Import, ast.ImportFrom))
                for a in n.names
            }
    return names


def broken_imports(package: Path = PACKAGE, others: Sequence[Path] = ()) -> List[str]:
    """ms_deepseek imports (function-local ones too, which only run on some paths) naming a module
    or a name that does not exist: what a move leaves behind. ``others``: more files to read
    (tools, tests), named by path."""
    modules = all_modules(package)
    defined = {name: top_level_names(path) for name, path in modules.items()}
    bad = []
    for name, path in list(modules.items()) + [(str(p), p) for p in others]:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                bad += [
                    f"{name}:{node.lineno}: no module {a.name}"
                    for a in node.names
                    if a.name.startswith("ms_deepseek.") and a.name not in modules
                ]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "ms_deepseek":
                if node.module not in modules:
                    bad.append(f"{name}:{node.lineno}: no module {node.module}")
                    continue
                for a in node.names:
                    if (
                        f"{node.module}.{a.name}" not in modules
                        and a.name not in defined[node.module]
                        and "*" not in defined[node.module]
                    ):
                        bad.append(f"{name}:{node.lineno}: {node.module} has no {a.name}")
    return bad


def test_every_import_names_something_that_exists():
    repo = PACKAGE.parent
    scripts = [p for d in ("tools", "tests") for p in sorted((repo / d).rglob("*.py"))]
    bad = broken_imports(others=scripts)
    assert not bad, "imports of what does not exist:\n" + "\n".join(bad)


def test_a_planted_broken_import_is_found(tmp_path):
    copy = mini_package(
        tmp_path,
        a="X = 1\n",
        b="def f():\n    from ms_deepseek.core import gone\n    from ms_deepseek.core.a import X, Y\n",
    )
    assert broken_imports(copy) == [
        "ms_deepseek.core.b:2: ms_deepseek.core has no gone",
        "ms_deepseek.core.b:3: ms_deepseek.core.a has no Y",
    ]


def test_a_planted_private_import_is_found(tmp_path):
    copy = mini_package(
        tmp_path, a="_X = 1\n__all__ = []\n", b="def f():\n    from ms_deepseek.core.a import _X, __all__\n"
    )
    assert private_imports(copy) == ["ms_deepseek/core/b.py:2: ms_deepseek.core.b imports ms_deepseek.core.a._X"]
