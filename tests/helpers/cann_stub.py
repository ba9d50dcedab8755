"""Stub CANN trees with the real trees' shape, for ops/build_ascend.sh, the Docker entrypoint
and the custom-op loader on a machine without CANN.

Three layouts of the Ascend C project template (what ``build_ascend.sh`` stages):

* ``cann9``: CANN 9.0.0 (asc-tools v9.0.0, ``utils/templates/op_project_templates/ascendc``,
  installed under ``$CANN/tools/``): ``customize/cmake/util/<helper>.py`` are relative symlinks
  to ``../../../common/util/<helper>.py`` and ``common/`` holds only ``util/``; the env script
  is ``$CANN/set_env.sh``.
* ``cann8``: CANN 8.x: ``customize/`` without the helpers, ``common/`` holds the helper files
  themselves (what MindSpore's ``custom_compiler/setup.py`` copies into ``cmake/util/``); the
  env script is ``$CANN/bin/setenv.bash``.
* ``sample``: the msopgen demo project (``ascendc_operator_sample``) with its own helpers.

Where the env script is (``env_at``): ``"cann"`` inside the toolkit as above; ``"toolkit"``
(``cann9`` only) as in the CANN 9.0.0 base image (cann-container-image,
``cann/9.0.0-910b-ubuntu22.04-py3.11/Dockerfile``): the toolkit is ``<root>/Ascend/cann-9.0.0``
without a script of its own, the image sources ``<root>/Ascend/ascend-toolkit/set_env.sh`` and
``ascend-toolkit/latest`` links to ``../cann-9.0.0``; ``"none"``: no env script anywhere (only a
base image's ENV can then name the toolkit).

The template's ``build.sh`` does what the real one does first: ``opts=$(python3
cmake/util/preset_parse.py CMakePresets.json)`` with no ``set -e``, then the build step
(real: cmake + ``func.cmake`` calling ``cmake/util/ascendc_*.py``), so a missing or
dangling helper fails the build with python's own "can't open file" and no package. The
"compiler" (``ascendc_bin_param_build.py`` here) reads the staged ``op_host/*.cpp`` OpDef
registrations as the real opbuild runs them (see COMPILE): comments stripped, for the SoC being
built the config object that its ``AddConfig("<soc>", <config>)`` call passes (``AddConfig("<soc>")``
alone carries no ``ExtendCfgInfo``), an explicit ``opFile.value`` and ``opInterface.value`` in it,
``op_kernel/<opFile>.cpp`` present and defining the kernel entry ``<opInterface>`` (the name the
compiler renames per tiling key). It writes a ``.run`` installer that lays out what MindSpore's loader reads
(``ops/operations/_custom_ops_utils.py``, ``CustomInfoGenerator``):
``op_impl/ai_core/tbe/config/<soc>/aic-<soc>-ops-info.json`` and
``op_api/include/aclnn_<op>.h``, for the SoC of ``ASCEND_COMPUTE_UNIT`` in the presets. The
installer prompts before replacing an existing vendor folder unless ``--quiet``, as CANN's does.
Every step appends a line to ``$STUB_LOG``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

# CANN 9.0.0's env script: reads $1 unguarded (dies under `set -u` with no arguments), and its
# last line is a probe that fails on a tree without that component (status 1).
SET_ENV = r"""# stub of CANN's set_env.sh / setenv.bash
if [ "$1" = "--force" ]; then :; fi
export LD_LIBRARY_PATH=@CANN@/lib64:$LD_LIBRARY_PATH
export ASCEND_HOME_PATH=@CANN@
export ASCEND_OPP_PATH=@CANN@/opp
export ASCEND_TOOLKIT_HOME=@CANN@
echo "setenv" >> "$STUB_LOG"
@EXTRA@
[ -d "@CANN@/tools/aoe" ] && export AOE_HOME=@CANN@/tools/aoe
"""

PRESET_PARSE = r"""import json, sys
# stub of cmake/util/preset_parse.py: the configure preset's cache variables as -D options
variables = json.load(open(sys.argv[1]))["configurePresets"][0]["cacheVariables"]
print(" ".join(f"-D{k}={v['value']}" for k, v in variables.items()))
"""

# Stands in for cmake + the kernel compiler: reads the OpDef registrations, writes the installer.
COMPILE = r'''import base64, json, os, re, sys
from pathlib import Path
project, opts = Path(sys.argv[1]), sys.argv[2:]
log = open(os.environ["STUB_LOG"], "a")
defs = dict(o[2:].split("=", 1) for o in opts if o.startswith("-D") and "=" in o)
if "ASCEND_COMPUTE_UNIT" not in defs:
    sys.exit("CMake Error at cmake/config.cmake: ASCEND_COMPUTE_UNIT not set in CMakePreset.json !")
soc, vendor = defs["ASCEND_COMPUTE_UNIT"], defs.get("vendor_name", "customize")
if not os.environ.get("ASCEND_HOME_PATH"):
    sys.exit("error: CANN environment not set")
DTYPES = {"DT_FLOAT": "float32", "DT_FLOAT16": "float16", "DT_BF16": "bfloat16", "DT_INT32": "int32",
          "DT_INT64": "int64"}
def code(path):
    # what the C++ compiler sees: no comments (opbuild compiles and runs the OpDef registrations)
    return re.sub(r"//[^\n]*|/\*.*?\*/", "", path.read_text(), flags=re.S)
def config_for(body, soc):
    """None when the OpDef registers no config for soc; else the ExtendCfgInfo of the config object
    passed to AddConfig(soc, <config>) ({} for AddConfig(soc) alone: metadef's default config)."""
    calls = re.findall(r'AddConfig\(\s*"(\w+)"\s*(?:,\s*(\w+)\s*)?\)', body)
    names = [name for s, name in calls if s == soc]
    if not names:
        return None
    if not names[-1]:
        return {}
    # every statement that starts from that object: `config.A(...).ExtendCfgInfo(...);`
    chains = re.findall(r"(?<![\w.>])" + names[-1] + r"\s*\.(.*?);", body, re.S)
    return dict(re.findall(r'ExtendCfgInfo\(\s*"([\w.]+)"\s*,\s*"(\w*)"\s*\)', " ".join(chains)))
info, headers = {}, {}
for src in sorted((project / "op_host").glob("*.cpp")):
    text = code(src)
    for m in re.finditer(r"class (\w+) : public OpDef \{(.*?)\n\};", text, re.S):
        name, body = m.group(1), m.group(2)
        config = config_for(body, soc)
        if config is None:
            continue
        # The real opbuild derives opFile and opInterface from the op type when the config does not
        # name them (a closed rule); the template then builds op_kernel/<opFile>.cpp (or, missing,
        # prints the error below and goes on without that kernel), and the compiler renames the
        # entry <opInterface> per tiling key (-D<opInterface>=<opInterface>_<key>_tilingkey). The
        # stub asks for both names explicitly and fails where the real build would drop or misname
        # the kernel.
        for key in ("opFile.value", "opInterface.value"):
            if not config.get(key):
                sys.exit(f"stub opbuild: {name}: the {soc} config sets no {key}")
        op_file, op_intf = config["opFile.value"], config["opInterface.value"]
        kernel_src = project / "op_kernel" / f"{op_file}.cpp"
        if not kernel_src.is_file():
            sys.exit(f"[ERROR]: operator: {op_file} source file: {kernel_src} does not found, please check.")
        entries = re.findall(r'extern\s+"C"\s+__global__\s+__aicore__\s+void\s+(\w+)\s*\(', code(kernel_src))
        if op_intf not in entries:
            sys.exit(f"stub compile: {name}: op_kernel/{op_file}.cpp defines no kernel entry {op_intf} "
                     f"(opInterface.value; found: {', '.join(entries) or 'none'}): "
                     f"-D{op_intf}={op_intf}_<key>_tilingkey renames nothing")
        entry, params = {}, []
        for kind in ("Input", "Output"):
            for i, (arg, dtypes) in enumerate(re.findall(kind + r'\("(\w+)"\)[^;]*?DataType\(\{([^}]*)\}\)', body)):
                dts = ",".join(DTYPES[d.strip().split("::")[-1]] for d in dtypes.split(","))
                entry[f"{kind.lower()}{i}"] = {"name": arg, "dtype": dts, "format": ",".join(["ND"] * len(dts.split(","))),
                                               "paramType": "required"}
                params.append((kind, arg))
        attrs = re.findall(r'Attr\("(\w+)"\)\.(\w+)\(\)', body)
        if attrs:
            entry["attr"] = {"list": ",".join(a for a, _ in attrs)}
            for a, t in attrs:
                entry[f"attr_{a}"] = {"type": t.lower(), "value": "all", "paramType": "required"}
        entry["opFile"] = {"value": op_file}
        entry["opInterface"] = {"value": op_intf}
        info[name] = entry
        ins = [f"const aclTensor *{a}" for k, a in params if k == "Input"]
        ins += [("double " if t == "Float" else "int64_t ") + a for a, t in attrs]
        outs = [f"const aclTensor *{a}" for k, a in params if k == "Output"]
        snake = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", re.sub(r"(.)([A-Z][a-z]+)", r"\1_\2", "aclnn" + name)).lower()
        headers[snake + ".h"] = (f"#include \"aclnn/acl_meta.h\"\naclnnStatus aclnn{name}GetWorkspaceSize("
                                 + ", ".join(ins + outs + ["uint64_t *workspaceSize", "aclOpExecutor **executor"])
                                 + f");\naclnnStatus aclnn{name}(void *workspace, uint64_t workspaceSize, "
                                 "aclOpExecutor *executor, aclrtStream stream);\n")
print(f"compiled {','.join(sorted(info))} for {soc}", file=log)
out = project / "build_out"
out.mkdir(exist_ok=True)
payload = base64.b64encode(json.dumps({"soc": soc, "vendor": vendor, "info": info, "headers": headers}).encode())
(out / "custom_opp_ubuntu_x86_64.run").write_text(r"""#!/bin/bash
# stub of the generated installer: prompts before replacing an existing vendor folder
quiet=n; path="${ASCEND_OPP_PATH:-}"
for a in "$@"; do
  case "$a" in --quiet) quiet=y ;; --install-path=*) path="${a#*=}" ;; esac
done
echo "install $*" >> "$STUB_LOG"
vendor="$path/vendors/""" + vendor + r""""
if [ -d "$vendor" ] && [ "$quiet" != y ]; then
  echo "[ops_custom] $vendor exists. Do you want to replace it? [y/n]"
  read -r answer
  [ "$answer" = y ] || exit 1
fi
python3 - "$vendor" """ + payload.decode() + r""" <<'PY'
import base64, json, sys
from pathlib import Path
d = json.loads(base64.b64decode(sys.argv[2]))
vendor = Path(sys.argv[1])
config = vendor / "op_impl/ai_core/tbe/config" / d["soc"]
config.mkdir(parents=True, exist_ok=True)
(config / f"aic-{d['soc']}-ops-info.json").write_text(json.dumps(d["info"], indent=2))
include = vendor / "op_api/include"
include.mkdir(parents=True, exist_ok=True)
for name, text in d["headers"].items():
    (include / name).write_text(text)
(vendor / "op_api/lib").mkdir(parents=True, exist_ok=True)
(vendor / "version.info").write_text(d["vendor"] + "\n")
PY
""")
'''

# The template's build.sh, as CANN 9.0.0's: no `set -e`, preset_parse.py first, then the build.
BUILD_SH = r"""#!/bin/bash
script_path=$(realpath $(dirname $0))
echo "build.sh ASCEND_HOME_PATH=${ASCEND_HOME_PATH:-unset} CUSTOM_OPP=${ASCEND_CUSTOM_OPP_PATH:-unset}" >> "$STUB_LOG"
mkdir -p build_out
rm -rf build_out/*
ls op_host > "$STUB_DIR/op_host.txt"
ls op_kernel > "$STUB_DIR/op_kernel.txt"
cp CMakePresets.json "$STUB_DIR/presets.json"
opts=$(python3 $script_path/cmake/util/preset_parse.py $script_path/CMakePresets.json)
@FAIL@
# cmake --build: func.cmake runs the helpers in cmake/util
python3 $script_path/cmake/util/ascendc_bin_param_build.py "$script_path" $opts
"""

PRESETS = {
    "version": 1,
    "configurePresets": [
        {
            "name": "default",
            "cacheVariables": {
                "ASCEND_CANN_PACKAGE_PATH": {"type": "PATH", "value": "/usr/local/Ascend/latest"},
                "ASCEND_COMPUTE_UNIT": {"type": "STRING", "value": "__ASCNED_COMPUTE_UNIT__"},
                "vendor_name": {"type": "STRING", "value": "customize"},
            },
        }
    ],
}

# A few of CANN 9.0.0's helper names (customize/cmake/util -> ../../../common/util).
HELPERS = {
    "preset_parse.py": PRESET_PARSE,
    "ascendc_bin_param_build.py": COMPILE,
    "const_var.py": "# stub\n",
    "opdesc_parser.py": "# stub\n",
}
LAYOUTS = ("cann9", "cann8", "sample")
ENV_AT = ("cann", "toolkit", "none")


def _project_files(project: Path, build_fail: str) -> None:
    for sub in ("op_host", "op_kernel"):
        (project / sub).mkdir(parents=True, exist_ok=True)
        (project / sub / "add_custom.cpp").write_text("// template demo operator\n")
        (project / sub / "CMakeLists.txt").write_text("# template\n")
    (project / "CMakePresets.json").write_text(json.dumps(PRESETS))
    (project / "build.sh").write_text(BUILD_SH.replace("@FAIL@", build_fail))
    (project / "cmake").mkdir(exist_ok=True)
    (project / "cmake" / "func.cmake").write_text("# template\n")


def make_stub_cann(
    root: Path,
    layout: str = "cann9",
    setenv_extra: str = "",
    build_fail: str = "",
    break_link: str = "",
    env_at: str = "cann",
) -> Path:
    """A stub CANN tree in ``layout`` (``root/cann``, or as in the 9.0.0 image
    ``root/Ascend/cann-9.0.0`` unless ``env_at="cann"``); ``break_link`` names a cann9 helper whose link target is removed (a
    dangling link in the CANN tree itself); ``env_at``: where the env script is (module doc)."""
    assert layout in LAYOUTS and env_at in ENV_AT, (layout, env_at)
    assert env_at != "toolkit" or layout == "cann9", "the ascend-toolkit/ layout is CANN 9.0.0's"
    cann = root / "Ascend" / "cann-9.0.0" if env_at != "cann" else root / "cann"
    (cann / "lib64").mkdir(parents=True)
    (cann / "opp" / "vendors").mkdir(parents=True)
    for soc in ("ascend910b", "ascend910_93"):  # the built-in ops' configs (MindSpore lists them last)
        (cann / "opp" / "built-in" / "op_impl" / "ai_core" / "tbe" / "config" / soc).mkdir(parents=True)
    env_text = SET_ENV.replace("@CANN@", str(cann)).replace("@EXTRA@", setenv_extra)
    templates = cann / "tools" / "op_project_templates" / "ascendc"
    if env_at == "toolkit":
        toolkit = root / "Ascend" / "ascend-toolkit"
        toolkit.mkdir(parents=True)
        (toolkit / "set_env.sh").write_text(env_text)
        os.symlink("../cann-9.0.0", toolkit / "latest")
    if layout == "cann9":
        if env_at == "cann":
            (cann / "set_env.sh").write_text(env_text)
        util = templates / "common" / "util"
        util.mkdir(parents=True)
        project = templates / "customize"
        _project_files(project, build_fail)
        (project / "cmake" / "util").mkdir()
        for name, text in HELPERS.items():
            if name != break_link:
                (util / name).write_text(text)
            os.symlink(f"../../../common/util/{name}", project / "cmake" / "util" / name)
    else:
        (cann / "bin").mkdir()
        if env_at == "cann":
            (cann / "bin" / "setenv.bash").write_text(env_text)
        if layout == "cann8":
            (templates / "common").mkdir(parents=True)
            _project_files(templates / "customize", build_fail)
            for name, text in HELPERS.items():
                (templates / "common" / name).write_text(text)
        else:
            project = cann / "tools/msopgen/template/operator_demo_projects/ascendc_operator_sample"
            _project_files(project, build_fail)
            (project / "cmake" / "util").mkdir()
            for name, text in HELPERS.items():
                (project / "cmake" / "util" / name).write_text(text)
    return cann


class FakeAscendContext:
    """Stands in for MSContext.get_instance() on Ascend: only the SoC name is read."""

    def __init__(self, soc):
        self.soc = soc

    def get_instance(self):
        return self

    def get_ascend_soc_version(self):
        return self.soc
