"""Issue 13 item 8: destinations that would destroy or pollute an input are refused before any write."""

import pytest

from bad_input_helpers import assert_refused, hf_copy, listing, run_cli
from data_helpers import make_byte_tokenizer, write_jsonl


@pytest.mark.parametrize("dst, extra, name", [("hf/sub", [], "lies inside the source"),
                                              ("hf/a/b", [], "lies inside the source"),
                                              ("hf", [], "is the source folder"),
                                              (".", ["--overwrite"], "holds the source")])
def test_convert(capsys, tmp_path, dst, extra, name):
    hf = hf_copy(tmp_path)
    (tmp_path / "other").write_text("keep")  # makes tmp_path non-empty
    before = listing(tmp_path)
    code, _, err = run_cli(capsys, ["convert", "hf-to-ms", hf, tmp_path / dst, "--no-progress", *extra])
    assert_refused(code, err, name)
    assert listing(tmp_path) == before


def test_convert_through_a_symlink_into_the_source(capsys, tmp_path):
    hf = hf_copy(tmp_path)
    (tmp_path / "link").symlink_to(hf)
    code, _, err = run_cli(capsys, ["convert", "hf-to-ms", hf, tmp_path / "link" / "sub", "--no-progress"])
    assert_refused(code, err, "lies inside the source")
    assert not (hf / "sub").exists()


@pytest.mark.parametrize("layout, output, inputs, name", [
    ("dir/in.jsonl", "dir", ["dir/in.jsonl"], "holds the input"),
    ("dir/in.jsonl", "dir", ["dir"], "holds the input"),
    ("corpus/in.jsonl", "corpus/prepared", ["corpus"], "lies inside the input folder"),
])
def test_prepare_data(capsys, tmp_path, layout, output, inputs, name):
    tok = make_byte_tokenizer(tmp_path / "tok")
    write_jsonl(tmp_path / layout, [{"text": "hello world " * 5}] * 5)
    before = listing(tmp_path)
    code, _, err = run_cli(capsys, ["prepare-data", *[tmp_path / i for i in inputs], "--tokenizer", tok,
                                    "--seq-len", "8", "--output", tmp_path / output, "--overwrite", "--no-progress"])
    assert_refused(code, err, name)
    assert listing(tmp_path) == before  # the input is still there, nothing was written
