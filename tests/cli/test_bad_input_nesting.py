"""Issue 13 item 5: runaway-nested JSON / YAML is one line naming the file, never a RecursionError."""

import json
import struct

import pytest

from bad_input_helpers import assert_refused, hf_copy, listing, run_cli

DEEP = 100_000


def deep() -> str:
    return "[" * DEEP + "]" * DEEP


def _config(hf):
    (hf / "config.json").write_text(deep())
    return "config.json: nested too deeply"


def _header(hf):
    blob = ('{"a":' * 20000 + "1" + "}" * 20000).encode()
    (hf / "model.safetensors").write_bytes(struct.pack("<Q", len(blob)) + blob)
    return "model.safetensors (safetensors header): nested too deeply"


def _index(hf):
    (hf / "model.safetensors.index.json").write_text(deep())
    return "model.safetensors.index.json: nested too deeply"


def _object_config(hf):
    (hf / "config.json").write_text('{"a":' * DEEP + "1" + "}" * DEEP)
    return "config.json: nested too deeply"


@pytest.mark.parametrize("spoil", [_config, _header, _index, _object_config])
def test_convert_inputs(capsys, tmp_path, spoil):
    hf = hf_copy(tmp_path)
    name = spoil(hf)
    before = listing(tmp_path)
    code, _, err = run_cli(capsys, ["convert", "hf-to-ms", hf, tmp_path / "out", "--no-progress"])
    assert_refused(code, err, name)
    assert listing(tmp_path) == before


@pytest.mark.parametrize("text", ["a: " + "{x: " * 5000 + "1" + "}" * 5000 + "\n",
                                  "- " * 5000 + "1\n"])
def test_recipes(capsys, tmp_path, text):
    (tmp_path / "r.yaml").write_text(text)
    code, _, err = run_cli(capsys, ["plan", "--recipe", tmp_path / "r.yaml"])
    assert_refused(code, err, "r.yaml: nested too deeply")


def test_metrics_line_is_a_warning(capsys, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n" + deep() + "\n"
                                       + json.dumps({"step": 2, "loss": 1.0}) + "\n")
    code, out, err = run_cli(capsys, ["report", run])
    assert code == 0 and "2 records" in out
    assert "metrics.jsonl:2: nested too deeply" in err


def test_jsonl_line_names_file_and_line(tmp_path):
    from ms_deepseek.data.readers import read_jsonl
    from ms_deepseek.core.errors import UserError

    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"text": "fine"}) + "\n" + '{"text": ' + deep() + "}\n")
    with pytest.raises(UserError, match=r"in\.jsonl:2: nested too deeply"):
        list(read_jsonl(src, "pretrain"))
