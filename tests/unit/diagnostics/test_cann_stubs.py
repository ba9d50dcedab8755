"""The stub CANN libraries of the compile check (diagnostics/cann_stubs), built from the installed wheel."""

import subprocess
import sys

from ms_deepseek.diagnostics import cann_stubs


def test_stubs_cover_what_the_ascend_plugin_needs_and_are_reused(tmp_path):
    first = cann_stubs.ensure_stubs(tmp_path)
    assert first.built and first.folder.parent == tmp_path
    # the CANN libraries the Ascend plugin links against (design.md section 8), each an empty library
    # with that SONAME depending on the one core that defines every missing symbol
    for name in ("libge_runner.so", "libhccl.so", "libascendcl.so", "libruntime.so", "libgraph.so"):
        assert name in first.missing and (first.folder / name).is_file(), name
        dyn = subprocess.run(["readelf", "-d", str(first.folder / name)], capture_output=True, text=True).stdout
        assert f"[{name}]" in dyn and "[libcann_stub_core.so]" in dyn, dyn
    assert first.symbols > 300
    assert (first.python_path / "hccl" / "sys_version.py").is_file()
    assert (first.folder / "include" / "acl" / "acl_base.h").is_file()
    again = cann_stubs.ensure_stubs(tmp_path)  # cached: same folder, nothing rebuilt
    assert not again.built and again.folder == first.folder and again.missing == first.missing


def test_mindspore_imports_its_ascend_plugin_against_the_stubs(tmp_path):
    """The oracle is MindSpore itself: with the stubs first on the library path, setting the Ascend device in
    a dry run loads the plugin (without them: it cannot, no CANN here)."""
    stubs = cann_stubs.ensure_stubs(tmp_path)
    env = stubs.env()
    env.update({"MS_SIMULATION_LEVEL": "0", "RANK_SIZE": "1", "RANK_ID": "0", "GLOG_v": "3"})
    code = "import mindspore as ms; ms.set_device('Ascend'); print(ms.get_context('device_target'))"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("Ascend"), proc.stderr[-2000:]
