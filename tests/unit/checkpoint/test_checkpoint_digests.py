"""Checkpoint digests: every file's SHA-256 is taken while it is written, kept in the
checkpoint's state.json, and checked wherever a checkpoint is read; a flipped byte is refused naming the file."""

import hashlib
import json

import numpy as np
import pytest

from bad_input_helpers import assert_refused, run_cli
from builders import small_config


def _flip(path, at=None, n=16):
    """Invert ``n`` bytes in the middle of ``path`` (how the tests damage model.safetensors)."""
    data = bytearray(path.read_bytes())
    at = len(data) // 2 if at is None else at
    data[at : at + n] = bytes(b ^ 0xFF for b in data[at : at + n])
    path.write_bytes(bytes(data))


def _training_checkpoint(tmp_path, step=2):
    """A whole training checkpoint of small_config's model, written by the trainer's own save."""
    from ms_deepseek.checkpoint.training import CheckpointManager
    from ms_deepseek.config.inventory import expected_ms_shapes

    cfg = small_config()
    rng = np.random.default_rng(step)
    model = {n: rng.standard_normal(s).astype(np.float32) for n, s in expected_ms_shapes(cfg).items()}
    optimizer = {f"adam_m.{n}": np.zeros_like(v) for n, v in model.items()}
    optimizer["global_step"] = np.array([step], np.int32)
    manager = CheckpointManager(tmp_path / "run" / "checkpoints", keep_last=5)
    return manager.save(step, model, optimizer, cfg, {"step": step}, "train: {}\n")


def test_digests_are_taken_while_writing_and_match_the_files(tmp_path):
    from ms_deepseek.checkpoint.digests import new_hasher
    from ms_deepseek.checkpoint.safetensors_io import OutTensor, write_arrays, write_file

    arrays = {"a": (np.arange(12, dtype=np.float32).reshape(3, 4), "BF16"), "b": (np.arange(5, dtype=np.int32), "I32")}
    hasher = new_hasher()
    size = write_arrays(tmp_path / "x.safetensors", arrays, digest=hasher)
    assert size == (tmp_path / "x.safetensors").stat().st_size
    assert hasher.hexdigest() == hashlib.sha256((tmp_path / "x.safetensors").read_bytes()).hexdigest()
    # byte ranges copied from another file (the converter's path): hashed through the user-space buffer
    from ms_deepseek.checkpoint.safetensors_io import read_header

    info = read_header(tmp_path / "x.safetensors").tensors["a"]
    copied = OutTensor("a", "BF16", (3, 4), pieces=((info.file, info.offset, info.nbytes),))
    hasher = new_hasher()
    write_file(tmp_path / "y.safetensors", [copied], {"format": "pt"}, digest=hasher)
    assert hasher.hexdigest() == hashlib.sha256((tmp_path / "y.safetensors").read_bytes()).hexdigest()


def test_a_training_checkpoint_records_every_file(tmp_path):
    folder = _training_checkpoint(tmp_path)
    files = json.loads((folder / "state.json").read_text())["files"]
    assert sorted(files) == ["config.json", "model.safetensors", "optimizer.safetensors", "recipe.yaml"]
    for name, entry in files.items():
        data = (folder / name).read_bytes()
        assert entry == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}, name


@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.safetensors", "config.json"])
def test_a_flipped_byte_is_refused_by_the_opener_naming_the_file(tmp_path, name):
    from ms_deepseek.checkpoint.opener import open_checkpoint
    from ms_deepseek.core.errors import UserError

    folder = _training_checkpoint(tmp_path)
    open_checkpoint(folder)  # intact
    if name == "config.json":  # a byte of a value: the file still parses
        text = (folder / name).read_text()
        (folder / name).write_text(text.replace('"rms_norm_eps": 1e-06', '"rms_norm_eps": 1e-05'))
        assert text != (folder / name).read_text()
    else:
        _flip(folder / name)
    with pytest.raises(UserError, match=f"{folder / name}: damaged checkpoint file"):
        open_checkpoint(folder)


def test_size_mode_checks_sizes_only(tmp_path, monkeypatch):
    from ms_deepseek.checkpoint.opener import open_checkpoint
    from ms_deepseek.core.errors import UserError

    folder = _training_checkpoint(tmp_path)
    _flip(folder / "model.safetensors")
    monkeypatch.setenv("MS_DEEPSEEK_VERIFY", "size")
    open_checkpoint(folder)  # a changed byte passes the size check (stated: the fast mode)
    with open(folder / "model.safetensors", "ab") as f:
        f.write(b"\0" * 8)
    with pytest.raises(UserError, match="damaged checkpoint file .* bytes"):
        open_checkpoint(folder)


def test_convert_refuses_a_damaged_checkpoint_and_writes_nothing(tmp_path, capsys):
    folder = _training_checkpoint(tmp_path)
    _flip(folder / "model.safetensors")
    code, _, err = run_cli(capsys, ["convert", "ms-to-hf", folder, tmp_path / "hf", "--no-progress"])
    assert_refused(code, err, str(folder / "model.safetensors"), "damaged")
    assert not (tmp_path / "hf").exists()


def test_a_resharded_checkpoint_records_its_rank_files_and_checks_them_when_read(tmp_path, capsys):
    from ms_deepseek.checkpoint.convert.sharded import write_sharded
    from ms_deepseek.config.parallel import ParallelConfig

    folder = _training_checkpoint(tmp_path)
    sharded = tmp_path / "sharded"
    write_sharded(folder, sharded, ParallelConfig(dp=2, ep=2, micro_batches=1), fsync=False)
    files = json.loads((sharded / "state.json").read_text())["files"]
    assert "rank_00001/model.safetensors" in files and "rank_00001/optimizer.safetensors" in files
    for name, entry in files.items():
        assert entry["sha256"] == hashlib.sha256((sharded / name).read_bytes()).hexdigest(), name
    code, _, err = run_cli(capsys, ["convert", "ms-to-hf", sharded, tmp_path / "hf", "--no-progress"])
    assert code == 0, err
    _flip(
        sharded / "rank_00001" / "model.safetensors",
        n=4,
        at=(sharded / "rank_00001" / "model.safetensors").stat().st_size - 64,
    )
    code, _, err = run_cli(capsys, ["convert", "ms-to-hf", sharded, tmp_path / "hf2", "--no-progress"])
    assert_refused(code, err, str(sharded / "rank_00001" / "model.safetensors"), "damaged")
    assert not (tmp_path / "hf2").exists()


def test_a_sharded_resume_checks_rank_files_by_size_up_front(tmp_path):
    """--resume of a sharded checkpoint: the rank files' sizes by the deciding rank, their bytes by the ranks
    that read them (ShardedSource, above); the small files in full."""
    from ms_deepseek.checkpoint.convert.sharded import write_sharded
    from ms_deepseek.checkpoint.digests import damage
    from ms_deepseek.config.parallel import ParallelConfig

    sharded = tmp_path / "sharded"
    write_sharded(_training_checkpoint(tmp_path), sharded, ParallelConfig(dp=2, micro_batches=1), fsync=False)
    rank_file = sharded / "rank_00001" / "optimizer.safetensors"
    _flip(rank_file, n=4)
    assert damage(sharded, ranks_by_size=True) is None
    assert str(rank_file) in damage(sharded)
    with open(rank_file, "ab") as f:
        f.write(b"\0" * 8)
    assert str(rank_file) in damage(sharded, ranks_by_size=True)
