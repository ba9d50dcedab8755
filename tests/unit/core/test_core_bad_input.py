"""core's output checks: stale partial folders of dead writers only are removed, a read-only folder is found
by trying."""

import os
import socket
import subprocess
import sys

import pytest

from ms_deepseek.core.atomic import remove_stale_partials
from ms_deepseek.core.errors import UserError
from ms_deepseek.core.safe_io import check_output_dir, check_output_file

from bad_input_helpers import listing

HOST = socket.gethostname().split(".")[0].replace("-", "_")


def _dead_pid():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_stale_partials_of_dead_writers_only(tmp_path):
    dst = tmp_path / "out"
    dead = tmp_path / f".out.partial-{HOST}-{_dead_pid()}-0123456789ab"
    live = tmp_path / f".out.partial-{HOST}-{os.getppid()}-0123456789ab"  # a live process
    elsewhere = tmp_path / f".out.partial-otherhost-{_dead_pid()}-0123456789ab"  # cannot tell: kept
    other = tmp_path / f".other.partial-{HOST}-{_dead_pid()}-0123456789ab"  # another destination
    for p in (dead, live, elsewhere, other):
        p.mkdir()
    assert remove_stale_partials(dst) == [dead]
    assert live.exists() and elsewhere.exists() and other.exists()


def test_read_only_folder_is_found_by_trying(tmp_path):
    # os.access says yes to root everywhere; the probe really creates a file
    check_output_file(tmp_path / "ok.html")
    check_output_dir(tmp_path / "new" / "deeper")
    assert listing(tmp_path) == set()
    with pytest.raises(UserError, match="is a file"):
        (tmp_path / "f").write_text("x")
        check_output_dir(tmp_path / "f")
    with pytest.raises(UserError, match="is a folder"):
        check_output_file(tmp_path)
