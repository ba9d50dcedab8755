"""Bad input to ``ms-deepseek report``: bad metrics.jsonl lines are warnings naming file:line, unwritable
outputs one line naming the path."""

import json

import pytest

from bad_input_helpers import assert_refused, deep, listing, run_cli


@pytest.mark.parametrize("step", ['"abc"', '"NaN"', "NaN", "-1", "1.5", "true", "null"])
def test_metrics_bad_step_is_a_warning(capsys, tmp_path, step):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(
        '{"step": 1, "loss": 2.0}\n{"step": ' + step + ', "loss": 1.0}\n{"step": 2, "loss": 1.5}\n'
    )
    code, out, err = run_cli(capsys, ["report", run])
    assert code == 0 and "2 records" in out
    assert "metrics.jsonl:2: " in err and err.startswith("warning: ")


def test_metrics_line_is_a_warning(capsys, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(
        json.dumps({"step": 1, "loss": 2.0}) + "\n" + deep() + "\n" + json.dumps({"step": 2, "loss": 1.0}) + "\n"
    )
    code, out, err = run_cli(capsys, ["report", run])
    assert code == 0 and "2 records" in out
    assert "metrics.jsonl:2: nested too deeply" in err


def _run(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n")
    return run


@pytest.mark.parametrize(
    "target, name",
    [("outdir", "outdir: is a folder"), ("/proc/r.html", "/proc/r.html"), ("afile/r.html", "afile is a file")],
)
def test_report_output(capsys, tmp_path, target, name):
    run = _run(tmp_path)
    (tmp_path / "outdir").mkdir()
    (tmp_path / "afile").write_text("x")
    before = listing(tmp_path)
    out = target if target.startswith("/") else tmp_path / target
    code, _, err = run_cli(capsys, ["report", run, "-o", out])
    assert_refused(code, err, name)
    assert listing(tmp_path) == before
