"""The stub CANN libraries of the compile check (verification/cann_stubs.py), built from the installed wheel."""

import subprocess
import sys

import pytest

from ms_deepseek.verification import cann_stubs


@pytest.mark.slow
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


@pytest.mark.slow
def test_mindspore_imports_its_ascend_plugin_against_the_stubs(tmp_path):
    """The oracle is MindSpore itself: with the stubs first on the library path, setting the Ascend device in
    a dry run loads the plugin (without them: it cannot, no CANN here)."""
    stubs = cann_stubs.ensure_stubs(tmp_path)
    env = stubs.env()
    env.update({"MS_SIMULATION_LEVEL": "0", "RANK_SIZE": "1", "RANK_ID": "0", "GLOG_v": "3"})
    code = "import mindspore as ms; ms.set_device('Ascend'); print(ms.get_context('device_target'))"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("Ascend"), proc.stderr[-2000:]


@pytest.mark.slow
def test_level1_stubs_sit_where_mindspore_looks_for_cann_and_fill_by_value_results(tmp_path):
    """MS_SIMULATION_LEVEL=1 dlopen()s <ascend path>/lib64/libascendcl.so ..., the ascend path cut from the
    file defining aclrtMalloc after its rightmost "cann" or "latest" (MindSpore symbol_utils.cc
    GetAscendPath); ge::OperatorFactory::CreateOperator returns a 24-byte object by value (design.md 8)."""
    import ctypes
    import platform

    stubs = cann_stubs.ensure_stubs(tmp_path, level=1)
    assert stubs.folder.name == "lib64" and stubs.folder.parent.name == "latest"
    core = stubs.folder / "libacl_stub_core.so"
    path = str(core)
    cut = max(path.rfind("cann"), path.rfind("latest"))  # what GetAscendPath does with this file's path
    assert path[:cut] + "latest/" == str(stubs.folder.parent) + "/"
    for name in (
        "libascendcl.so",
        "libacl_op_compiler.so",
        "libacl_tdt_channel.so",
        "libmsprofiler.so",
        "libopapi.so",
        "libacl_tdt_queue.so",
    ):
        assert (stubs.folder / name).is_file(), name
    lib = ctypes.CDLL(path)
    for name in ("aclrtMalloc", "aclInit", "aclnnInit", "aclopCreateAttr", "HcclCommInitRootInfo"):
        assert getattr(lib, name)() == 0, name
    assert stubs.symbols > cann_stubs.ensure_stubs(tmp_path).symbols + 500  # the ~700 ACL names besides
    if platform.machine() == "x86_64":  # the caller's result buffer comes as the first argument
        buf = ctypes.create_string_buffer(32)
        ctypes.memset(buf, 0xFF, 32)
        fn = lib._ZN2ge15OperatorFactory14CreateOperatorEPKcS2_
        fn.restype = ctypes.c_void_p
        assert fn(buf, None, None) == ctypes.addressof(buf)
        assert buf.raw[:24] == b"\0" * 24 and buf.raw[24:32] == b"\xff" * 8  # 24 bytes, not one more


_GE_STATUS_USER = r"""
// what a GE_ERRORNO does at load (graphengine inc/external/ge/ge_api_error_codes.h): a static registrar whose
// constructor inserts into the singleton's map through inline code of the caller, old-ABI std::string as in CANN
#include <cstdint>
#include <cstdio>
#include <map>
#include <string>
namespace ge {
class StatusFactory {
 public:
  static StatusFactory *Instance();
  void RegisterErrorNo(uint32_t err, const std::string &desc) {
    if (err_desc_.find(err) != err_desc_.end()) return;
    err_desc_[err] = desc;
  }
  std::string GetErrDesc(uint32_t err) { auto it = err_desc_.find(err); return it == err_desc_.end() ? "" : it->second; }
  size_t Size() const { return err_desc_.size(); }
 private:
  std::map<uint32_t, std::string> err_desc_;
};
struct ErrorNoRegisterar {
  ErrorNoRegisterar(uint32_t err, const std::string &desc) { StatusFactory::Instance()->RegisterErrorNo(err, desc); }
};
}
static ge::ErrorNoRegisterar a(0, "Success"), b(0xFFFFFFFFu, "Failed"), c(0, "again");
int main() {
  ge::StatusFactory *f = ge::StatusFactory::Instance();
  std::printf("%zu %s %s\n", f->Size(), f->GetErrDesc(0).c_str(), f->GetErrDesc(0xFFFFFFFFu).c_str());
  return 0;
}
"""


def _status_factory_user(tmp_path, monkeypatch, constructed):
    import shutil

    import pytest

    if not (shutil.which("g++") and shutil.which("gcc")):
        pytest.skip("g++ and gcc build the check of a singleton stub")
    monkeypatch.setattr(cann_stubs, "CONSTRUCTED", constructed)
    (tmp_path / "core.c").write_text(cann_stubs._c_source({"_ZN2ge13StatusFactory8InstanceEv": "FUNC"}))
    core = tmp_path / "libcore.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-w", "-o", str(core), str(tmp_path / "core.c")], check=True)
    (tmp_path / "user.cc").write_text(_GE_STATUS_USER)
    exe = tmp_path / "user"
    cxx = ["g++", "-D_GLIBCXX_USE_CXX11_ABI=0", "-O1", "-o", str(exe), str(tmp_path / "user.cc")]
    subprocess.run([*cxx, f"-L{tmp_path}", "-lcore", f"-Wl,-rpath,{tmp_path}"], check=True)
    return subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)


def test_a_singleton_a_static_initializer_fills_is_a_constructed_empty_map(tmp_path, monkeypatch):
    """MindSpore 2.10's plugin/ascend/libd_collective.so registers GE error codes at load through
    ge::StatusFactory::Instance(): the stub hands back an empty std::map the caller's own code inserts into."""
    proc = _status_factory_user(tmp_path, monkeypatch, cann_stubs.CONSTRUCTED)
    assert proc.returncode == 0 and proc.stdout.split() == ["2", "Success", "Failed"], proc


def test_a_singleton_stub_returning_0_crashes_at_load(tmp_path, monkeypatch):
    """The plant: the getter stubbed like every other function (return 0) segfaults in the static initializer,
    as MindSpore 2.10 did."""
    proc = _status_factory_user(tmp_path, monkeypatch, {})
    assert proc.returncode < 0, proc
