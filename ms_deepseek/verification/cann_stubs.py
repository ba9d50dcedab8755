"""Stub CANN libraries, so that MindSpore's dry run compiles sharded graphs on a host without CANN.

MindSpore's Ascend plugin (``mindspore/lib/plugin/libmindspore_ascend.so.2`` and the libraries
under ``plugin/ascend/``) links against CANN libraries (``libge_runner.so``, ``libhccl.so``,
``libascendcl.so``, ...). At ``MS_SIMULATION_LEVEL=0`` (compile only) none of their functions is
called except static registrations at load (``ge::OperatorCreatorRegister``; from MindSpore 2.10 also
``ge::StatusFactory::Instance()``, see :data:`CONSTRUCTED`), so libraries that define every symbol the
plugin needs, each returning 0 but for those registrations, let the real parallel frontend run
(docs/measurements.md, "MindSpore's dry run on a CPU host"; MindSpore 2.9.0 and 2.10.0).

:func:`ensure_stubs` builds them once per MindSpore version, Python and machine into the user's
cache folder, from the installed wheel itself:

1. walk the ``NEEDED`` closure of the plugin's libraries (``readelf -d``: RPATH/RUNPATH with
   ``$ORIGIN``, the wheel's library folders, the system's ``ldconfig`` cache); a library found
   nowhere is *missing*;
2. collect the undefined, non-weak dynamic symbols of the closure's own libraries
   (``readelf --dyn-syms``) that no library of the closure (nor the Python executable) defines;
3. compile one C file with a ``long f(void) { return 0; }`` per symbol (its mangled name given
   with ``__asm__``; a singleton getter a static initializer uses returns a constructed object instead,
   :data:`CONSTRUCTED`) into ``libcann_stub_core.so``, and give every missing library an empty
   ``.so`` with that SONAME which depends on the core;
4. write ``py/hccl/sys_version.py`` (``mindspore.communication.init()`` imports it).

Nothing is downloaded: gcc and readelf (binutils) do the work in a few seconds. On a host with
CANN (``ASCEND_HOME_PATH``) none of this is needed.

``ensure_stubs(level=1)`` builds a second folder for ``MS_SIMULATION_LEVEL=1`` (compile, then run one
step without kernels and account its device memory), which needs three more things (docs/measurements.md,
"MindSpore's dry run on a CPU host"):

* a CANN tree MindSpore can find: it takes the file that defines ``aclrtMalloc`` (``dladdr``), cuts its
  path after the rightmost ``cann`` or ``latest`` and dlopen()s ``lib64/libascendcl.so``,
  ``lib64/libacl_op_compiler.so``, ... under it (MindSpore
  ``plugin/ascend/res_manager/symbol_interface/symbol_utils.cc`` ``GetAscendPath`` /
  ``LoadAscendApiSymbols``). So the level-1 libraries live in ``<folder>/latest/lib64/`` and the core's
  own name holds neither word;
* the ACL names it then looks up with ``dlsym`` (``acl*``, ``aclrt*``, ``aclnn*``, ``aclop*``, ``aclmdl*``,
  ``aclprof*``, ``acltdt*``, ``rt*``, ``Hccl*``: every such name in the plugin's strings), each returning 0;
  under simulation MindSpore replaces the ``aclrt`` calls with its own (``LoadSimulationApiSymbols``);
* ``ge::OperatorFactory::CreateOperator`` returns a 24-byte ``ge::Operator`` by value (through the
  hidden result pointer): its stub zero-fills it, else MindSpore crashes setting up aclop kernels.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Set, Tuple

from ms_deepseek.core.errors import UserError

STUB_VERSION = 4  # bump when what is built changes: the cache key includes it
SIM_STUB_VERSION = 2  # the level-1 folder's own version (bump when what it holds changes)
HCCL_VERSION = "8.1.0"  # what mindspore.communication's _check_version reads from hccl.sys_version


@dataclass
class StubSet:
    folder: Path  # put on LD_LIBRARY_PATH
    python_path: Path  # put on PYTHONPATH (the hccl.sys_version module)
    missing: List[str] = field(default_factory=list)  # library names given a stub
    symbols: int = 0  # function symbols defined by the stub core
    built: bool = False  # built by this call (False: taken from the cache)
    root: Optional[Path] = None  # the folder holding opp/, include/, py/ (default: ``folder``)

    def env(self, base: Optional[Dict[str, str]] = None) -> Dict[str, str]:
        """``base`` (default: this process's environment) with the stubs found first."""
        env = dict(os.environ if base is None else base)
        env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(self.folder), env.get("LD_LIBRARY_PATH", "")) if p)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(self.python_path), env.get("PYTHONPATH", "")) if p)
        env.setdefault("ASCEND_OPP_PATH", str((self.root or self.folder) / "opp"))
        return env


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "ms-deepseek" / "cann-stubs"


def _mindspore_dir() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("mindspore")
    if spec is None or not spec.origin:
        raise UserError("mindspore is not installed in this Python: the compile check needs the wheel's Ascend plugin")
    return Path(spec.origin).parent


def _mindspore_version(ms_dir: Path) -> str:
    text = (ms_dir / "version.py").read_text() if (ms_dir / "version.py").is_file() else ""
    m = re.search(r"""__version__\s*=\s*['"]([^'"]+)""", text)
    return m.group(1) if m else "unknown"


def cache_key(ms_dir: Optional[Path] = None, level: int = 0) -> str:
    ms_dir = ms_dir or _mindspore_dir()
    key = (
        f"ms{_mindspore_version(ms_dir)}-{platform.machine()}-cp{sys.version_info[0]}{sys.version_info[1]}"
        f"-v{STUB_VERSION}"
    )
    return key if level == 0 else f"{key}-level1-v{SIM_STUB_VERSION}"


def plugin_roots(ms_dir: Path) -> List[Path]:
    """The Ascend plugin's libraries, the roots of the NEEDED walk."""
    plugin = ms_dir / "lib" / "plugin"
    roots = sorted(plugin.glob("libmindspore_ascend.so*")) + sorted(plugin.glob("libmindspore_ops_ascend.so*"))
    # the AICPU kernels (libmindspore_cpu_kernels.so) are built for the device's Arm cores: not ours to load
    roots += sorted(p for p in (plugin / "ascend").glob("*.so") if p.is_file() and _same_machine(p))
    if not roots:
        raise UserError(f"{plugin}: no Ascend plugin in this MindSpore wheel (libmindspore_ascend.so.*)")
    return roots


def _run(argv: List[str]) -> str:
    try:
        return subprocess.run(argv, check=True, capture_output=True, text=True).stdout
    except FileNotFoundError:
        raise UserError(
            f"{argv[0]}: not found; the CANN stubs need gcc and readelf (Debian: apt-get install gcc binutils)"
        ) from None
    except subprocess.CalledProcessError as e:
        raise UserError(
            f"{' '.join(argv[:3])}...: failed ({e.stderr.strip().splitlines()[-1:] or e.returncode})"
        ) from None


def _same_machine(lib: Path) -> bool:
    """True when ``lib`` is built for this host's architecture (``readelf -h``'s Machine)."""
    header = _run(["readelf", "-h", str(lib)])
    m = re.search(r"Machine:\s+(.*)", header)
    want = {"x86_64": "X86-64", "aarch64": "AArch64"}.get(platform.machine(), "")
    return m is None or not want or want in m.group(1)


_DYN = re.compile(r"\((NEEDED|RPATH|RUNPATH)\)\s+.*?\[(.*)\]")


def _dynamic(lib: Path) -> Tuple[List[str], List[str]]:
    """(NEEDED names, RPATH/RUNPATH folders with $ORIGIN resolved) of one ELF file."""
    needed, paths = [], []
    for kind, value in _DYN.findall(_run(["readelf", "-d", "-W", str(lib)])):
        if kind == "NEEDED":
            needed.append(value)
        else:
            origin = str(lib.parent)
            paths += [p.replace("$ORIGIN", origin).replace("${ORIGIN}", origin) for p in value.split(":") if p]
    return needed, paths


def _system_libs() -> Dict[str, Path]:
    """soname -> path from the dynamic linker's cache (``ldconfig -p``), this machine's ABI only."""
    out: Dict[str, Path] = {}
    try:
        text = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    except FileNotFoundError:
        text = ""
    for line in text.splitlines():
        m = re.match(r"\s*(\S+)\s+\(([^)]*)\)\s+=>\s+(\S+)", line)
        if m and (platform.machine().replace("_", "-") in m.group(2) or "x86-64" not in m.group(2)):
            out.setdefault(m.group(1), Path(m.group(3)))
    return out


def _symbols(lib: Path) -> Tuple[Set[str], Dict[str, str]]:
    """(defined dynamic symbols, undefined non-weak ones -> their type) of one ELF file."""
    defined: Set[str] = set()
    undefined: Dict[str, str] = {}
    for line in _run(["readelf", "--dyn-syms", "-W", str(lib)]).splitlines():
        parts = line.split()
        # Num: Value Size Type Bind Vis Ndx Name
        if len(parts) < 8 or not parts[0].endswith(":"):
            continue
        kind, bind, ndx, name = parts[3], parts[4], parts[6], parts[7]
        name = name.split("@")[0]
        if not name:
            continue
        if ndx == "UND":
            if bind == "GLOBAL":
                undefined[name] = kind
        elif bind in ("GLOBAL", "WEAK", "UNIQUE"):
            defined.add(name)
    return defined, undefined


@dataclass
class Closure:
    found: Dict[str, Path]  # library name -> path (the wheel's and the system's)
    missing: List[str]  # NEEDED names found nowhere (CANN's)
    own: List[Path]  # the wheel's own libraries in the closure (whose undefined symbols count)


def walk_closure(roots: Iterable[Path], ms_dir: Path) -> Closure:
    """The NEEDED closure of ``roots``: every library resolved as the dynamic linker would look for
    it (RPATH/RUNPATH, the wheel's folders, the system cache), or named missing."""
    system = _system_libs()
    arch = f"{platform.machine()}-linux-gnu"
    system_dirs = [f"/lib/{arch}", f"/usr/lib/{arch}", "/lib64", "/usr/lib64", "/lib", "/usr/lib"]
    wheel_dirs = [
        ms_dir,
        ms_dir / "lib",
        ms_dir / "lib" / "plugin",
        ms_dir / "lib" / "plugin" / "ascend",
        ms_dir / "lib" / "plugin" / "cpu",
    ]
    found: Dict[str, Path] = {}
    missing: Set[str] = set()
    own: List[Path] = []
    queue = [(p.name, p) for p in roots]
    seen: Set[str] = set()
    while queue:
        name, path = queue.pop()
        if str(path) in seen:
            continue
        seen.add(str(path))
        found[name] = path
        is_own = str(path).startswith(str(ms_dir))
        if is_own:
            own.append(path)
        needed, rpaths = _dynamic(path)
        for dep in needed:
            if dep in found or dep in missing:
                continue
            hit = (
                next((Path(d) / dep for d in rpaths + [str(w) for w in wheel_dirs] if (Path(d) / dep).is_file()), None)
                or system.get(dep)
                or next((Path(d) / dep for d in system_dirs if (Path(d) / dep).is_file()), None)
            )
            if hit is None:
                missing.add(dep)
            elif is_own or str(hit).startswith(str(ms_dir)):
                queue.append((dep, hit))
            else:
                found[dep] = hit  # a system library: its symbols count as defined, its own deps are its own
    return Closure(found, sorted(missing), own)


def stub_symbols(closure: Closure, defined_out: Optional[Set[str]] = None) -> Dict[str, str]:
    """Undefined non-weak symbols of the wheel's libraries that nothing in the closure defines (the defined
    names are added to ``defined_out`` when given)."""
    defined: Set[str] = set() if defined_out is None else defined_out
    wanted: Dict[str, str] = {}
    for path in closure.found.values():
        d, u = _symbols(path)
        defined |= d
        if path in closure.own:
            wanted.update(u)
    exe = Path(sys.executable).resolve()  # Py* symbols come from the interpreter
    defined |= _symbols(exe)[0]
    for lib in Path(sys.base_prefix, "lib").glob("libpython*.so*"):
        defined |= _symbols(lib)[0]
    return {n: k for n, k in sorted(wanted.items()) if n not in defined}


# functions that return a C++ object by value: the caller passes the result's address (x86-64: first
# argument; AArch64: x8) and reads the object after the call; a stub must hand back a zeroed object
# (ge::Operator, 24 bytes; a stub that leaves it unset segfaults level 1: docs/measurements.md, "MindSpore's dry run
# on a CPU host")
BY_VALUE = {
    "_ZN2ge15OperatorFactory14CreateOperatorEPKcS2_": 24,
    "_ZN2ge15OperatorFactory14CreateOperatorERKSsS2_": 24,
    "_ZN2ge15OperatorFactory14CreateOperatorERKNSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEES8_": 24,
}
# singleton getters that a static initializer of the plugin calls at load and then uses: a stub must return a real,
# constructed object of the same layout, not 0. ge::StatusFactory (graphengine inc/external/ge/ge_api_error_codes.h)
# holds one std::map<uint32_t, std::string> err_desc_; every GE_ERRORNO in a library is a static ErrorNoRegisterar
# whose constructor runs StatusFactory::Instance()->RegisterErrorNo(err, desc), inlined into the caller (MindSpore
# 2.10's plugin/ascend/libd_collective.so, libmindspore_graph_ir.so, ...), which inserts into that map. The stub is
# an empty libstdc++ std::map (bits/stl_tree.h _Rb_tree_impl: the 8-byte key compare, then the header node
# {color red = 0, parent = 0, left = right = &header}, then the node count): the plugin's own inlined code allocates
# and links the nodes (old-ABI std::string values), and no destructor of ours ever touches them.
CONSTRUCTED = {
    "_ZN2ge13StatusFactory8InstanceEv": (
        "static struct {{ long compare; int color; void *parent, *left, *right; unsigned long count; }}\n"
        "    status_factory = {{0, 0, 0, &status_factory.color, &status_factory.color, 0}};\n"
        'void *f_{i}(void) __asm__("{name}");\nvoid *f_{i}(void) {{ return &status_factory; }}'
    ),
}
# what MindSpore's plugin dlsym()s from the CANN tree it found: ACL, ACLNN, runtime and HCCL entry points
_ACL_NAME = re.compile(
    rb"(?<![A-Za-z0-9_])((?:acl|aclrt|aclnn|aclop|aclmdl|aclprof|acltdt|rt|Hccl|mstx)[A-Z][A-Za-z0-9_]*)"
)
# and the libraries it dlopen()s under that tree (``<ascend path>/lib64/...``)
_ACL_LIB = re.compile(rb"lib64/((?:driver/)?lib[A-Za-z0-9_]+\.so)(?![A-Za-z0-9_.])")
# dlopen()ed under <ascend path>/lib64 by its bare name (measured: symbol_utils.cc GetLibHandler's "Dlopen ... failed")
_ACL_LIB_BARE = ("libacl_tdt_queue.so",)


def _by_value_stub(i: int, name: str, size: int) -> str:
    if platform.machine() == "aarch64":
        take = 'void *ret; __asm__ volatile("mov %0, x8" : "=r"(ret));'
        return (
            f'void *f_{i}(void) __asm__("{name}");\nvoid *f_{i}(void) {{ {take} memset(ret, 0, {size}); return ret; }}'
        )
    return (
        f'void *f_{i}(void *ret) __asm__("{name}");\nvoid *f_{i}(void *ret) {{ memset(ret, 0, {size}); return ret; }}'
    )


def _c_source(symbols: Dict[str, str]) -> str:
    lines = [
        "/* generated by ms_deepseek.verification.cann_stubs: every CANN symbol MindSpore's Ascend plugin",
        "   needs, returning 0 (compile-only dry run: none of them is called but static registrations) */",
        "#include <string.h>",
    ]
    for i, (name, kind) in enumerate(symbols.items()):
        if name in BY_VALUE:
            lines.append(_by_value_stub(i, name, BY_VALUE[name]))
        elif name in CONSTRUCTED:
            lines.append(CONSTRUCTED[name].format(i=i, name=name))
        elif kind == "OBJECT":
            lines.append(f'char o_{i}[256] __asm__("{name}");')
        else:
            lines.append(f'long f_{i}(void) __asm__("{name}");\nlong f_{i}(void) {{ return 0; }}')
    return "\n".join(lines) + "\n"


def build_stubs(dest: Path, ms_dir: Optional[Path] = None) -> StubSet:
    """Build the stub folder at ``dest`` (atomically: a temporary sibling renamed into place)."""
    ms_dir = ms_dir or _mindspore_dir()
    closure = walk_closure(plugin_roots(ms_dir), ms_dir)
    symbols = stub_symbols(closure)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        (tmp / "cann_stub_core.c").write_text(_c_source(symbols))
        cc = os.environ.get("CC", "gcc")
        _run(
            [
                cc,
                "-shared",
                "-fPIC",
                "-O0",
                "-w",
                "-o",
                str(tmp / "libcann_stub_core.so"),
                str(tmp / "cann_stub_core.c"),
                "-Wl,-soname,libcann_stub_core.so",
            ]
        )
        empty = tmp / "empty.c"
        empty.write_text("/* a missing CANN library: its symbols come from libcann_stub_core.so */\n")
        for name in closure.missing:
            _run(
                [
                    cc,
                    "-shared",
                    "-fPIC",
                    "-o",
                    str(tmp / name),
                    str(empty),
                    f"-Wl,-soname,{name}",
                    "-Wl,--no-as-needed",
                    f"-L{tmp}",
                    "-lcann_stub_core",
                    "-Wl,-rpath,$ORIGIN",
                ]
            )
        _write_support(tmp, ms_dir)
        (tmp / "MANIFEST").write_text(
            "\n".join(
                [
                    f"mindspore {_mindspore_version(ms_dir)}",
                    f"symbols {len(symbols)}",
                    *(f"missing {n}" for n in closure.missing),
                ]
            )
            + "\n"
        )
        return _install(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def acl_names(roots: Iterable[Path], defined: Set[str]) -> Tuple[List[str], List[str]]:
    """(ACL function names, library paths under the CANN tree) named in the plugin's strings, minus the names
    a library of the closure defines (a stub must not interpose on MindSpore's own)."""
    names: Set[str] = set()
    libs: Set[str] = set()
    for lib in roots:
        data = lib.read_bytes()
        names.update(m.decode() for m in _ACL_NAME.findall(data))
        libs.update(m.decode() for m in _ACL_LIB.findall(data))
    return sorted(n for n in names if n not in defined), sorted(libs | set(_ACL_LIB_BARE))


def build_level1_stubs(dest: Path, ms_dir: Optional[Path] = None) -> StubSet:
    """The stub folder for ``MS_SIMULATION_LEVEL=1``: everything of :func:`build_stubs`, plus the ACL names
    MindSpore dlsym()s, in ``dest/latest/lib64`` (found by MindSpore's ``GetAscendPath``)."""
    ms_dir = ms_dir or _mindspore_dir()
    roots = plugin_roots(ms_dir)
    closure = walk_closure(roots, ms_dir)
    defined: Set[str] = set()
    symbols = stub_symbols(closure, defined)
    names, acl_libs = acl_names(roots, defined)
    for n in names:
        symbols.setdefault(n, "FUNC")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        lib64 = tmp / "latest" / "lib64"
        lib64.mkdir(parents=True)
        core = "libacl_stub_core.so"  # neither "cann" nor "latest" in its name: GetAscendPath cuts at the rightmost
        (tmp / "acl_stub_core.c").write_text(_c_source(symbols))
        cc = os.environ.get("CC", "gcc")
        _run(
            [
                cc,
                "-shared",
                "-fPIC",
                "-O0",
                "-w",
                "-o",
                str(lib64 / core),
                str(tmp / "acl_stub_core.c"),
                f"-Wl,-soname,{core}",
            ]
        )
        _link_to_core(cc, tmp, lib64, core, sorted(set(closure.missing) | set(acl_libs)))
        _write_support(tmp, ms_dir)
        (tmp / "MANIFEST").write_text(
            "\n".join(
                [
                    f"mindspore {_mindspore_version(ms_dir)}",
                    "level 1",
                    f"symbols {len(symbols)}",
                    "libdir latest/lib64",
                    *(f"missing {n}" for n in sorted(set(closure.missing) | set(acl_libs))),
                ]
            )
            + "\n"
        )
        return _install(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _link_to_core(cc: str, tmp: Path, lib64: Path, core: str, libraries) -> None:
    """Each CANN library name as an empty library that links the core stub (which defines every symbol)."""
    empty = tmp / "empty.c"
    empty.write_text("/* a CANN library: its symbols come from libacl_stub_core.so */\n")
    for name in libraries:
        target = lib64 / name
        target.parent.mkdir(parents=True, exist_ok=True)
        rpath = "$ORIGIN" if target.parent == lib64 else "$ORIGIN/.."
        _run(
            [
                cc,
                "-shared",
                "-fPIC",
                "-o",
                str(target),
                str(empty),
                f"-Wl,-soname,{Path(name).name}",
                "-Wl,--no-as-needed",
                f"-L{lib64}",
                "-l" + core[3:-3],
                f"-Wl,-rpath,{rpath}",
            ]
        )


def _write_support(tmp: Path, ms_dir: Path) -> None:
    """The non-library parts of a stub folder: CANN's acl header, the opp folder, ``hccl.sys_version``."""
    # what MindSpore's custom-op path reads from a CANN tree (mindspore/ops/operations/custom_ops.py
    # _compile_aot: the generated aclnn callback is compiled with -I<ASCEND_OPP_PATH before "opp">/include;
    # _custom_ops_utils.py CustomInfoGenerator lists <ASCEND_OPP_PATH>/built-in/.../config/<soc>)
    acl = tmp / "include" / "acl"
    acl.mkdir(parents=True)
    (acl / "acl_base.h").write_text(
        "/* stub of CANN's acl/acl_base.h for the compile-only dry run */\n"
        "#pragma once\n#include <stdint.h>\n#include <stddef.h>\n"
        "typedef int aclError;\ntypedef void *aclrtStream;\n"
    )
    (tmp / "opp" / "built-in" / "op_impl" / "ai_core" / "tbe" / "config").mkdir(parents=True)
    hccl = tmp / "py" / "hccl"
    hccl.mkdir(parents=True)
    (hccl / "__init__.py").write_text("")
    (hccl / "sys_version.py").write_text(f'__sys_version__ = "{HCCL_VERSION}"  # read by mindspore.communication\n')


def _install(tmp: Path, dest: Path) -> StubSet:
    if dest.exists() and _read_manifest(dest) is None:
        shutil.rmtree(dest)  # an incomplete folder (an older layout): replaced
    try:
        os.replace(tmp, dest)
    except OSError:
        if _read_manifest(dest) is None:
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # another process built it meanwhile: theirs serves
        return _read_manifest(dest)
    made = _read_manifest(dest)
    made.built = True
    return made


def _read_manifest(folder: Path) -> Optional[StubSet]:
    manifest = folder / "MANIFEST"
    if not manifest.is_file():
        return None
    missing, symbols, libdir = [], 0, folder
    for line in manifest.read_text().splitlines():
        key, _, value = line.partition(" ")
        if key == "missing":
            missing.append(value)
        elif key == "symbols":
            symbols = int(value)
        elif key == "libdir":
            libdir = folder / value
    if not any(libdir.glob("lib*_stub_core.so")):
        return None
    stubs = StubSet(libdir, folder / "py", missing, symbols)
    stubs.root = folder
    return stubs


def ensure_stubs(root: Optional[Path] = None, level: int = 0) -> StubSet:
    """The stub folder for the installed MindSpore and dry-run level (0: compile only; 1: compile and run
    one step without kernels), built on first use into ``root`` (default: the user's cache folder, keyed by
    MindSpore version, machine, Python and level)."""
    if level not in (0, 1):
        raise UserError(f"MS_SIMULATION_LEVEL {level}: the CANN stubs serve levels 0 and 1 only")
    ms_dir = _mindspore_dir()
    folder = (root or cache_root()) / cache_key(ms_dir, level)
    existing = _read_manifest(folder)
    if existing is not None:
        return existing
    return build_stubs(folder, ms_dir) if level == 0 else build_level1_stubs(folder, ms_dir)
