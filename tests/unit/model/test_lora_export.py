"""export-lora (model/lora_export.py) and the folders it reads and writes: it never deletes what it reads (OUT
that is, holds or lies inside an input is refused before anything is written, and the PEFT / base writers replace
an old folder only once the new one is in place), and the random base of a run is recorded by its absolute path.
The run-folder cases are in tests/unit/train/test_lora_train.py (they need a run)."""

import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from ms_deepseek.cli import main

from repo_paths import FIXTURES

FIX = FIXTURES / "lora"


@pytest.fixture()
def inputs(tmp_path):
    adapter = tmp_path / "work" / "adapter"
    shutil.copytree(FIX / "ours_adapter", adapter)
    base = tmp_path / "bases" / "base"
    shutil.copytree(FIX / "base", base)
    return adapter, base


def _listing(folder: Path):
    return sorted((str(p.relative_to(folder)), p.stat().st_size) for p in folder.rglob("*"))


@pytest.mark.parametrize("where", ["adapter", "inside_adapter", "holds_adapter", "inside_base"])
def test_merge_refuses_an_output_that_overlaps_an_input(inputs, where, capsys):
    adapter, base = inputs
    out = {
        "adapter": adapter,
        "inside_adapter": adapter / "merged",
        "holds_adapter": adapter.parent,
        "inside_base": base / "merged",
    }[where]
    before = (_listing(adapter), _listing(base))
    code = main(["export-lora", str(adapter), str(out), "--merge", str(base), "--overwrite"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "input folder" in err[0], err
    assert (_listing(adapter), _listing(base)) == before


def test_write_adapter_keeps_a_complete_folder_when_the_final_rename_fails(tmp_path, monkeypatch):
    """A crash between removing the old adapter and renaming the new one in must not leave OUT empty."""
    from ms_deepseek.model import lora_peft

    out = tmp_path / "adapter"
    cfg = {"r": 2}
    lora_peft.write_adapter(out, {"a": np.zeros(2, np.float32)}, cfg)

    def broken(*_a, **_k):
        raise OSError("simulated crash at the final rename")

    monkeypatch.setattr(os, "replace", broken)
    monkeypatch.setattr(os, "rename", broken)
    try:
        lora_peft.write_adapter(out, {"a": np.ones(2, np.float32)}, cfg, overwrite=True)
    except OSError:
        pass
    monkeypatch.undo()
    assert (out / lora_peft.WEIGHTS_NAME).is_file() and (out / lora_peft.CONFIG_NAME).is_file()


def test_export_lora_records_an_absolute_random_base(tmp_path, monkeypatch):
    from ms_deepseek.model.lora_export import run_base

    step = tmp_path / "runs" / "r" / "checkpoints" / "step_00000002"
    step.mkdir(parents=True)
    (tmp_path / "runs" / "r" / "base").mkdir()
    (tmp_path / "runs" / "r" / "base" / "model.safetensors").write_bytes(b"")
    monkeypatch.chdir(tmp_path)
    base = run_base(Path("runs/r/checkpoints/step_00000002"), {"source": "tiny"})
    assert base.is_absolute() and base == (tmp_path / "runs" / "r" / "base").resolve()
