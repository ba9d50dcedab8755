"""Nothing outside a class or module touches its private (``_name``) names (ARCHITECTURE.md, "Public names
across modules").

Every module of the package is read with ``ast``; a hit is

* ``obj._name`` where ``obj`` is anything but ``self``, ``cls`` or ``super()`` (another object's private
  attribute or method, or another module's private function), unless ``obj`` is rooted in a name
  imported from outside the package (MindSpore's own internals, ``os._exit``: not ours to rename);
* ``from ms_deepseek.x import _name`` (another module's private name).

Dunder names (``__name__``, ``__dataclass_fields__``) are public by Python's convention.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import List, Set

from repo_paths import REPO

PACKAGE = REPO / "ms_deepseek"


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _outside_names(tree: ast.AST) -> Set[str]:
    """Names bound by imports of modules outside the package."""
    names: Set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if not a.name.startswith("ms_deepseek"):
                    names.add(a.asname or a.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.module and not node.module.startswith("ms_deepseek"):
            names.update(a.asname or a.name for a in node.names)
    return names


def _root(node: ast.AST) -> ast.AST:
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node


def _own(value: ast.AST) -> bool:
    """``self``, ``cls`` or ``super()``: the class's own names."""
    if isinstance(value, ast.Name):
        return value.id in ("self", "cls")
    return isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "super"


def private_access(source: str, filename: str = "<source>") -> List[str]:
    """``file:line: what`` for every access to another object's or module's private name in ``source``."""
    tree = ast.parse(source, filename)
    outside = _outside_names(tree)
    hits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr) and not _own(node.value):
            root = _root(node.value)
            if not (isinstance(root, ast.Name) and root.id in outside):
                hits.append(f"{filename}:{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ms_deepseek"):
            for a in node.names:
                if _private(a.name):
                    hits.append(f"{filename}:{node.lineno}: from {node.module} import {a.name}")
    return sorted(set(hits))


def package_hits(package: Path = PACKAGE) -> List[str]:
    hits = []
    for path in sorted(package.rglob("*.py")):
        hits += private_access(path.read_text(encoding="utf-8"), str(path.relative_to(REPO)))
    return hits


def test_no_module_touches_another_objects_private_names():
    hits = package_hits()
    assert not hits, "private names used from outside their class or module:\n" + "\n".join(hits)


def test_a_planted_private_access_is_reported():
    planted = (
        "import os\n"
        "from mindspore.common.api import _cell_graph_executor\n"
        "from ms_deepseek.train import trainer\n"
        "from ms_deepseek.ops.cpu import _custom\n"
        "class A:\n"
        "    def f(self, other):\n"
        "        self._x = other._y\n"
        "        super()._g()\n"
        "        trainer._helper()\n"
        "        self.parts[0]._inner\n"
        "        os._exit(0)\n"
        "        _cell_graph_executor._get_func_graph_proto\n"
        "        return self.__class__\n"
    )
    assert private_access(planted, "planted.py") == [
        "planted.py:10: self.parts[0]._inner",
        "planted.py:4: from ms_deepseek.ops.cpu import _custom",
        "planted.py:7: other._y",
        "planted.py:9: trainer._helper",
    ]


def test_own_private_names_are_not_reported():
    own = "class A:\n    def f(self):\n        return self._x + type(self).__name__\n    @classmethod\n    def g(cls):\n        return cls._y\n"
    assert private_access(own) == []
