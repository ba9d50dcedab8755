"""The operator information of our Ascend C ops, read from their OpDef registrations (``op_host/*.cpp``).

On a CANN host, ``ops/build_ascend.sh`` compiles and installs the ops, and the installer writes
``op_impl/ai_core/tbe/config/<soc>/aic-<soc>-ops-info.json``, which MindSpore reads to register an
``ops.Custom("<OpType>", func_type="aot")`` (``mindspore/ops/operations/_custom_ops_utils.py``,
``CustomInfoGenerator._get_op_json`` / ``_generate_reg_info``: per op ``input<i>`` / ``output<i>``
with name, dtype, format and paramType, ``attr`` with the attribute list and ``attr_<name>`` each).

The compile check (``plan --compile``: MindSpore's dry run, no CANN) needs the custom ops in the graph
as they would be with the kernels installed, so it writes that same file from the sources
(:func:`write_vendor`): the graph's frontend (strategies, layouts) sees the real registration; no
kernel is built or run.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Dict

from ms_deepseek.core.errors import UserError

# ge::DataType -> the dtype names of the ops-info file
_DTYPES = {
    "DT_FLOAT": "float32",
    "DT_FLOAT16": "float16",
    "DT_BF16": "bfloat16",
    "DT_INT32": "int32",
    "DT_INT64": "int64",
    "DT_INT8": "int8",
    "DT_UINT8": "uint8",
    "DT_BOOL": "bool",
}
_ATTR_TYPES = {
    "Int": "int",
    "Float": "float",
    "Bool": "bool",
    "String": "str",
    "ListInt": "listInt",
    "ListFloat": "listFloat",
}


def sources_root() -> Path:
    """The kernel sources shipped with the package (``ms_deepseek/ops_src``, the repository's ``ops/``)."""
    return Path(__file__).resolve().parents[1] / "ops_src"


def _strip_comments(text: str) -> str:
    return re.sub(r"//[^\n]*|/\*.*?\*/", "", text, flags=re.S)


def op_info(source: Path) -> Dict[str, Dict]:
    """Op type -> its ops-info entry, for every ``class X : public OpDef`` in one op_host source."""
    text = _strip_comments(source.read_text(encoding="utf-8"))
    out: Dict[str, Dict] = {}
    for m in re.finditer(r"class\s+(\w+)\s*:\s*public\s+OpDef\s*\{(.*?)\n\};", text, re.S):
        name, body = m.group(1), m.group(2)
        entry: Dict[str, Dict] = {}
        for kind in ("Input", "Output"):
            found = re.findall(kind + r'\("(\w+)"\)(.*?);', body, re.S)
            for i, (arg, chain) in enumerate(found):
                dt = re.search(r"DataType\(\{([^}]*)\}\)", chain)
                if dt is None:
                    raise UserError(f"{source}: {name}.{kind}({arg}) has no DataType list")
                names = [d.strip().split("::")[-1] for d in dt.group(1).split(",") if d.strip()]
                dtypes = ",".join(_DTYPES.get(d, d.lower()) for d in names)
                entry[f"{kind.lower()}{i}"] = {
                    "name": arg,
                    "dtype": dtypes,
                    "format": ",".join(["ND"] * len(names)),
                    "paramType": "required",
                }
        attrs = re.findall(r'Attr\("(\w+)"\)\s*\.\s*(\w+)\(\)', body)
        if attrs:
            entry["attr"] = {"list": ",".join(a for a, _ in attrs)}
            for a, t in attrs:
                entry[f"attr_{a}"] = {"type": _ATTR_TYPES.get(t, t.lower()), "value": "all", "paramType": "required"}
        # the kernel file and its entry, as the OpDef names them (opFile.value, opInterface.value)
        op_file = re.search(r'"opFile\.value"\s*,\s*"(\w+)"', body)
        entry["opFile"] = {"value": op_file.group(1) if op_file else source.stem}
        op_intf = re.search(r'"opInterface\.value"\s*,\s*"(\w+)"', body)
        entry["opInterface"] = {"value": op_intf.group(1) if op_intf else entry["opFile"]["value"]}
        out[name] = entry
    return out


def all_op_info(root: Path = None) -> Dict[str, Dict]:
    root = root or sources_root()
    info: Dict[str, Dict] = {}
    for source in sorted(root.glob("*/op_host/*.cpp")):
        info.update(op_info(source))
    if not info:
        raise UserError(f"{root}: no OpDef registrations found under */op_host/*.cpp")
    return info


def write_vendor(folder: Path, soc: str) -> Path:
    """A vendor folder holding our ops' ops-info file for ``soc``, laid out as CANN's installer lays it out;
    returns the folder (for ``ASCEND_CUSTOM_OPP_PATH``)."""
    config = folder / "op_impl" / "ai_core" / "tbe" / "config" / soc
    config.mkdir(parents=True, exist_ok=True)
    (config / f"aic-{soc}-ops-info.json").write_text(json.dumps(all_op_info(), indent=2))
    return folder
