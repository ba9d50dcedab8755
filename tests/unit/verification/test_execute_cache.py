"""The one-device run's cache (verification/execute/cache.py): a run is reused only by a run that would compute it alike.

Every input the one-device run reads changes the key: a recipe value, the content of a file the recipe names (not its
path), the batches, the step count, a ``sitecustomize`` module on the run's ``PYTHONPATH``; a stored entry is copied
back whole, and nothing is stored without a cache folder or half-written."""

import dataclasses

import numpy as np
import pytest

from ms_deepseek.verification.execute import cache


@dataclasses.dataclass
class _Recipe:
    lr: float
    source: str


@pytest.fixture
def inputs(tmp_path):
    weights = tmp_path / "run_a" / "weights"
    weights.mkdir(parents=True)
    (weights / "model.safetensors").write_bytes(b"weights")
    batches = {"ids_1": np.arange(8, dtype=np.int32).reshape(2, 4), "labels_1": np.ones((2, 4), np.int32)}
    request = {"recipe": "/some/where.yaml", "overrides": [f"model.source={weights}"], "steps": 2}
    return _Recipe(1e-3, str(weights)), batches, request, {"MS_DEEPSEEK_OPS": "reference"}


def test_the_key_follows_every_input_and_not_the_paths(tmp_path, inputs):
    recipe, batches, request, env = inputs
    base = cache.key(recipe, batches, request, env)
    assert cache.key(recipe, batches, request, env) == base
    # the same content in another run's folder and another recipe path: the same run
    other = tmp_path / "run_b" / "weights"
    other.mkdir(parents=True)
    (other / "model.safetensors").write_bytes(b"weights")
    moved = dict(request, recipe="/else/where.yaml", overrides=[f"model.source={other}"])
    assert cache.key(_Recipe(1e-3, str(other)), batches, moved, env) == base

    (other / "model.safetensors").write_bytes(b"weighty")
    changed = [
        _Recipe(2e-3, recipe.source),
        _Recipe(1e-3, str(other)),
    ]
    assert all(cache.key(r, batches, request, env) != base for r in changed)
    swapped = dict(batches, ids_1=batches["ids_1"][::-1].copy())
    assert cache.key(recipe, swapped, request, env) != base
    assert cache.key(recipe, batches, dict(request, steps=3), env) != base
    assert cache.key(recipe, batches, request, dict(env, MS_DEEPSEEK_OPS="custom")) != base
    site = tmp_path / "plant"
    site.mkdir()
    (site / "sitecustomize.py").write_text("x = 1\n")
    planted = cache.key(recipe, batches, request, dict(env, PYTHONPATH=str(site)))
    assert planted != base
    (site / "sitecustomize.py").write_text("x = 2\n")
    assert cache.key(recipe, batches, request, dict(env, PYTHONPATH=str(site))) != planted


def _run_outputs(folder):
    folder.mkdir(parents=True)
    (folder / "result.json").write_text('{"steps": []}')
    for step in (0, 1):
        (folder / f"values_{step}.safetensors").write_bytes(bytes([step]) * 4)
    (folder / "reference.log").write_text("not kept")


def test_store_and_restore_copy_the_run_whole(tmp_path, monkeypatch):
    out, again = tmp_path / "one_device", tmp_path / "again"
    _run_outputs(out)
    again.mkdir()
    monkeypatch.delenv(cache.ENV, raising=False)
    cache.store("k", out)
    assert not cache.restore("k", again) and not list(again.iterdir())  # no cache folder: nothing kept

    monkeypatch.setenv(cache.ENV, str(tmp_path / "cache"))
    assert not cache.restore("k", again)
    cache.store("k", out)
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["k"]  # no partial folder left behind
    assert cache.restore("k", again)
    assert sorted(p.name for p in again.iterdir()) == ["result.json", "values_0.safetensors", "values_1.safetensors"]
    assert (again / "values_1.safetensors").read_bytes() == b"\x01" * 4
    assert not cache.restore("other", tmp_path)
