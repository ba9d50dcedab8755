"""Shared test setup.

* Every test runs with a temporary working directory, so MindSpore's compile
  droppings (rank_*/, kernel_meta/) never land in the checkout.
* The embedded default corpus is cached in a session temporary folder (MS_DEEPSEEK_CACHE), and so is
  ``plan --execute``'s one-device run (MS_DEEPSEEK_EXECUTE_CACHE): the planted-mistake runs of a recipe share it.
* Every temporary file of the session, in this process and the ones it starts, goes under one session folder
  (``TMPDIR``) removed at exit: what a failing run keeps on purpose for its user, like ``plan --execute``'s work
  folder of a planted mistake, does not pile up in /tmp.
* MindSpore logs only errors; mindformers (imported lazily by the trainer) logs
  into the temporary folder.
* Tests marked ``ascend`` are skipped unless an Ascend device is present.
* Tiers (tests/helpers/tiers.py): every test under tests/compile, tests/lines and tests/msrun, and every test marked
  ``msrun``, is marked ``slow`` (the full tier); a test that starts a compile or an msrun job without a ``slow``,
  ``heavy`` or ``smoke`` mark fails.
* PyNative launches ops synchronously (``launch_blocking``): faster on a 2-core CPU.
"""

import atexit
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

import tiers
from repo_paths import FIXTURES, REPO  # tests/helpers is on pytest's pythonpath (pytest.ini)

os.environ.setdefault("GLOG_v", "3")
# One session folder, made by the first process (xdist's workers inherit it, never nest their own), with a short
# name: a Unix socket a program makes under TMPDIR (Chromium's ``.org.chromium.Chromium.XXXXXX/SingletonSocket``)
# must fit the 107 bytes of ``sun_path`` (unix(7)). pytest's own tmp_path folders stay where they were
# (/tmp/pytest-of-<user>, three sessions kept).
os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", tempfile.gettempdir())
_TMP = os.environ.get("MS_DEEPSEEK_TEST_TMP")
if not _TMP:
    _TMP = os.environ["MS_DEEPSEEK_TEST_TMP"] = tempfile.mkdtemp(prefix="msd-test-")
    atexit.register(shutil.rmtree, _TMP, True)
os.environ["TMPDIR"] = tempfile.tempdir = _TMP
# The embedded corpus is built once per test session in a temporary folder, never in ~/.cache.
_CACHE = tempfile.mkdtemp(prefix="ms-deepseek-test-cache-")
os.environ.setdefault("MS_DEEPSEEK_CACHE", _CACHE)
os.environ.setdefault("MS_DEEPSEEK_EXECUTE_CACHE", os.path.join(_CACHE, "one-device"))
atexit.register(shutil.rmtree, _CACHE, True)
os.environ.setdefault("MS_SUBMODULE_LOG_v", "{}")


def pytest_configure(config):
    # PyNative on CPU launches ops asynchronously at ~1 ms each on 2 cores; blocking launch is
    # 2-10x faster here and changes no result (design.md). Tests run PyNative and graph mode.
    import mindspore as ms

    ms.runtime.launch_blocking()


def ascend_available() -> bool:
    from ms_deepseek.core.runtime import detect_device

    return detect_device() == "Ascend"


# what the running test started that only a slow, heavy or smoke test may start (tiers.launches_heavy_work)
_STARTED: list = []
_popen_init = subprocess.Popen.__init__


def _recording_popen_init(self, args, *rest, **kwargs):
    what = tiers.launches_heavy_work(args, kwargs.get("env"))
    if what:
        _STARTED.append(what)
    _popen_init(self, args, *rest, **kwargs)


subprocess.Popen.__init__ = _recording_popen_init


def pytest_itemcollected(item):
    where = str(Path(str(item.path)).relative_to(REPO / "tests"))
    marks = {m.name for m in item.iter_markers()}
    marker = tiers.tier_marker(where, marks)
    if marker:
        item.add_marker(marker)


def pytest_collection_finish(session):
    # one line per collected test with its tier marks, for tests/repo/test_tiers.py (pytest --collect-only -m "")
    if os.environ.get(tiers.LIST_ENV):
        for item in session.items:
            marks = sorted({m.name for m in item.iter_markers()} & {"slow", "heavy", "smoke", "lines"})
            print(f"TIER {item.nodeid} {','.join(marks)}")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    _STARTED.clear()  # before the fixtures of the test, whatever their scope
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    result = yield
    if _STARTED and not any(item.get_closest_marker(m) for m in tiers.MAY_COMPILE):
        started = sorted(set(_STARTED))
        _STARTED.clear()
        pytest.fail(
            f"{item.nodeid} started {', '.join(started)}: only a test marked slow (or smoke, for the default tier's "
            "one compile and one execution) may; see ARCHITECTURE.md, where a test goes",
            pytrace=False,
        )
    return result


def pytest_collection_modifyitems(config, items):
    if ascend_available():
        return
    skip = pytest.mark.skip(reason="needs an Ascend NPU and CANN (not on this host)")
    for item in items:
        if "ascend" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _run_in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LOG_MF_PATH", str(tmp_path / "mf_log"))
    yield


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    return FIXTURES


@pytest.fixture(scope="module", autouse=True)
def _restore_execution_mode():
    """Many modules switch MindSpore to graph mode; give the next module the mode it had."""
    import mindspore as ms

    mode = ms.get_context("mode")
    yield
    ms.set_context(mode=mode)
