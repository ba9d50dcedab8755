"""Issue 13 item 9: nothing of a failed command stays behind; a later run cleans up a killed one."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import yaml

from bad_input_helpers import assert_refused, edit_config, hf_copy, listing, run_cli
from data_helpers import make_byte_tokenizer, write_jsonl
from ms_deepseek.core.atomic import remove_stale_partials

HOST = socket.gethostname().split(".")[0].replace("-", "_")


def _dead_pid():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_stale_partials_of_dead_writers_only(tmp_path):
    dst = tmp_path / "out"
    dead = tmp_path / f".out.partial-{HOST}-{_dead_pid()}-0123456789ab"
    live = tmp_path / f".out.partial-{HOST}-{os.getppid()}-0123456789ab"   # a live process
    elsewhere = tmp_path / f".out.partial-otherhost-{_dead_pid()}-0123456789ab"  # cannot tell: kept
    other = tmp_path / f".other.partial-{HOST}-{_dead_pid()}-0123456789ab"     # another destination
    for p in (dead, live, elsewhere, other):
        p.mkdir()
    assert remove_stale_partials(dst) == [dead]
    assert live.exists() and elsewhere.exists() and other.exists()


def test_sigkilled_conversion_is_cleaned_by_the_next_run(capsys, tmp_path):
    hf = hf_copy(tmp_path)
    code = ("import os, time\n"
            "import ms_deepseek.checkpoint.convert as api\n"
            "def stuck(*a, **k):\n"
            "    open(os.environ['READY'], 'w').close(); time.sleep(120)\n"
            "api._write_shards = stuck\n"
            f"api.hf_to_ms({str(hf)!r}, {str(tmp_path / 'out')!r}, progress=False)\n")
    ready = tmp_path / "ready"
    proc = subprocess.Popen([sys.executable, "-c", code], env=dict(os.environ, READY=str(ready)))
    deadline = time.time() + 120
    while not ready.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert ready.exists(), "the writer did not start"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    ready.unlink()
    partials = [p for p in tmp_path.iterdir() if p.name.startswith(".out.partial-")]
    assert len(partials) == 1  # what SIGKILL leaves
    code, _, err = run_cli(capsys, ["convert", "hf-to-ms", hf, tmp_path / "out", "--no-progress"])
    assert code == 0, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "out"]


def test_failed_conversion_removes_the_parents_it_created(capsys, tmp_path):
    hf = edit_config(hf_copy(tmp_path), intermediate_size=7)  # the tensors no longer match
    before = listing(tmp_path)
    code, _, err = run_cli(capsys, ["convert", "hf-to-ms", hf, tmp_path / "a" / "b" / "out", "--no-progress"])
    assert code == 2, err
    assert listing(tmp_path) == before


@pytest.mark.parametrize("bad", ["{not json", '{"no_text": 1}', '{"text": 5}'])
def test_failed_prepare_data_leaves_no_parent_folders(capsys, tmp_path, bad):
    tok = make_byte_tokenizer(tmp_path / "tok")
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"text": "fine"}) + "\n" + bad + "\n")
    before = listing(tmp_path)
    code, _, err = run_cli(capsys, ["prepare-data", src, "--tokenizer", tok, "--seq-len", "8", "--output",
                                    tmp_path / "a" / "b" / "c", "--no-progress"])
    assert_refused(code, err, "in.jsonl:2")
    assert listing(tmp_path) == before


def _recipe(tmp_path, source, data):
    recipe = {"model": {"source": str(source)}, "data": {"path": str(data), "num_workers": 1},
              "train": {"steps": 2, "micro_batch_size": 2}, "logging": {"tensorboard": False},
              "checkpoint": {"save_interval": 0}}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def test_train_refused_for_a_bad_checkpoint_shape_leaves_nothing(capsys, tmp_path):
    tok = make_byte_tokenizer(tmp_path / "tok")
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "hello world " * 8}] * 20)
    code, _, err = run_cli(capsys, ["prepare-data", src, "--tokenizer", tok, "--seq-len", "16", "--output",
                                    tmp_path / "data", "--no-progress"])
    assert code == 0, err
    hf = edit_config(hf_copy(tmp_path), vocab_size=512)  # embed/lm_head rows (256) no longer match
    recipe = _recipe(tmp_path, hf, tmp_path / "data")
    before = listing(tmp_path)
    for run in (tmp_path / "runs" / "new", tmp_path / "data_run"):
        code, _, err = run_cli(capsys, ["train", recipe, "--output", run])
        assert_refused(code, err, "model.embed_tokens.weight has shape [256, 64]")  # checked when opened
        leftovers = listing(tmp_path) - before
        assert not {p for p in leftovers if not p.startswith("mf_log")}, leftovers


def test_train_refusal_in_an_existing_run_folder_keeps_its_files(capsys, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "notes.txt").write_text("mine")
    recipe = _recipe(tmp_path, "tiny", tmp_path / "missing-data")
    code, _, err = run_cli(capsys, ["train", recipe, "--output", run])
    assert code == 2, err
    assert listing(run) == {"notes.txt"}


def test_launch_with_an_unresolvable_master_creates_nothing(capsys, tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"model": {"source": "tiny"}, "data": {"seq_len": 16, "embedded_vocab_size": 512},
                                      "train": {"steps": 1, "micro_batch_size": 1}}))
    before = listing(tmp_path)
    code, _, err = run_cli(capsys, ["launch", recipe, "--master-addr", "no-such-host.invalid", "--output",
                                    tmp_path / "runs" / "r"])
    assert_refused(code, err, "--master-addr: cannot resolve 'no-such-host.invalid'")
    assert listing(tmp_path) == before
