"""tools/compare_lines.py, which fails CI when the two MindSpore lines' results differ: equal results pass, and a
changed loss, a changed count, a NaN, a result one line lacks and two empty folders each fail."""

import json
import subprocess
import sys

import pytest

from repo_paths import REPO

TOOL = REPO / "tools" / "compare_lines.py"
RESULT = {
    "loss": [[6.238347053527832, 6.238347053527832], [6.23747444152832, 6.23747444152832]],
    "compared": 498,
    "agrees": True,
    "communication": {"AllGather": {"count": 42, "mb": 4.6}},
}


def _write(folder, name, result, version):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.json").write_text(json.dumps({"name": name, "mindspore": version, "result": result}))


def _compare(tmp_path, second_result, second_name="execute v2-lite-sft-8npu"):
    _write(tmp_path / "a", "execute v2-lite-sft-8npu", RESULT, "2.9.0")
    if second_result is not None:
        _write(tmp_path / "b", second_name, second_result, "2.10.0")
    (tmp_path / "b").mkdir(exist_ok=True)
    run = subprocess.run([sys.executable, str(TOOL), str(tmp_path / "a"), str(tmp_path / "b")], capture_output=True)
    return run.returncode, run.stdout.decode(), run.stderr.decode()


def test_equal_results_agree_and_a_float32_rounding_is_counted(tmp_path):
    code, out, err = _compare(tmp_path, RESULT)
    assert code == 0 and "same    execute v2-lite-sft-8npu" in out and "1 results compared, 0 differences" in out, err
    rounded = json.loads(json.dumps(RESULT))
    rounded["loss"][1][1] = 6.2374749183654785  # the next float32 after 6.23747444152832
    code, out, err = _compare(tmp_path, rounded)
    assert code == 0 and "1 values within 4 float32 spacings" in out, (out, err)


@pytest.mark.parametrize(
    "change, says",
    [
        (lambda r: r["loss"][1].__setitem__(1, 6.2375), "loss[1][1]: 6.23747444152832 against 6.2375"),
        (lambda r: r.__setitem__("compared", 497), "compared: 498 against 497"),
        (lambda r: r.__setitem__("agrees", False), "agrees: True against False"),
        (lambda r: r["loss"][0].__setitem__(0, float("nan")), "not a finite number"),
        (lambda r: r["communication"].pop("AllGather"), "keys ['AllGather'] on one line only"),
    ],
)
def test_a_difference_fails_and_names_where(tmp_path, change, says):
    changed = json.loads(json.dumps(RESULT))
    change(changed)
    code, out, err = _compare(tmp_path, changed)
    assert code == 1 and says in err, (out, err)


def test_a_result_one_line_lacks_and_empty_folders_fail(tmp_path):
    code, _, err = _compare(tmp_path, RESULT, second_name="compile v2-lora-16npu")
    assert code == 1 and "execute v2-lite-sft-8npu: no result on the second line" in err, err
    assert "compile v2-lora-16npu: no result on the first line" in err, err
    (tmp_path / "c").mkdir()
    (tmp_path / "d").mkdir()
    run = subprocess.run([sys.executable, str(TOOL), str(tmp_path / "c"), str(tmp_path / "d")], capture_output=True)
    assert run.returncode == 1 and b"nothing was compared" in run.stderr
    run = subprocess.run([sys.executable, str(TOOL), str(tmp_path / "c"), str(tmp_path / "e")], capture_output=True)
    assert run.returncode == 2 and run.stderr.decode().strip() == f"compare_lines: {tmp_path / 'e'}: no such folder"
