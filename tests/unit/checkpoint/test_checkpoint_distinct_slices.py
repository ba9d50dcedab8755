"""Pre-sharded conversion stores each distinct slice once.

``convert hf-to-ms --dp/--tp...`` and ``convert reshard`` do not write dp identical copies of every
replicated slice (every reader takes the lowest rank's): the lowest rank holding a slice (its owner,
``ShardLayout.distinct_slices``) stores it and layout.json says so (version 2, ``"slices": "distinct"``);
version-1 folders (every rank stores all of its slices: older conversions, training checkpoints) still read.
"""

import filecmp
import json

import numpy as np
from safetensors.numpy import load_file

from ms_deepseek import cli
from ms_deepseek.checkpoint.convert.sharded import load_rank, rank_entries
from ms_deepseek.checkpoint.convert.synthetic import write_random_checkpoint
from ms_deepseek.checkpoint.layout import LAYOUT_FILE, ExpertIds, build_layout, rank_dir_name, read_layout
from ms_deepseek.checkpoint.opener import open_checkpoint
from ms_deepseek.checkpoint.safetensors_io import DTYPE_SIZES, read_header, write_file
from ms_deepseek.config.model import DeepseekV2Config
from ms_deepseek.config.parallel import ParallelConfig
from ms_deepseek.config.recipe import load_recipe, planning_config_path

from builders import small_config
from repo_paths import RECIPES as REPO_RECIPES  # noqa: E402


def _bytes(folder):
    """(file bytes, tensor data bytes) of the rank files."""
    files = list(folder.glob("rank_*/*.safetensors"))
    size = sum(p.stat().st_size for p in files)
    return size, size - sum(read_header(p).data_start for p in files)


def _layout_bytes(layout):
    """(bytes every rank storing its slices, bytes with each distinct slice once), by the layout alone."""

    def nbytes(name, sl):
        t = layout.tensors[name]
        n = DTYPE_SIZES[t.dtype]
        for s in sl:
            n *= len(s) if isinstance(s, ExpertIds) else s[1] - s[0]
        return n

    every = sum(nbytes(n, layout.slice_of(n, r)) for r in range(layout.world_size) for n in layout.tensors_of_rank(r))
    once = sum(nbytes(n, sl) for n in layout.tensors for _, sl in layout.distinct_slices(n))
    return every, once


def test_dp4_stores_each_slice_once_and_reads_back_the_same(tmp_path, capsys):
    write_random_checkpoint(tmp_path / "hf", small_config(), dtype="bfloat16", seed=5)
    model_bytes = (tmp_path / "hf" / "model.safetensors").stat().st_size
    for flags in (["--dp", "4"], ["--dp", "4", "--tp", "2", "--ep", "2"]):
        dst = tmp_path / ("sh" + "".join(flags))
        assert cli.main(["convert", "hf-to-ms", str(tmp_path / "hf"), str(dst), "--no-progress", *flags]) == 0
        layout = read_layout(dst)
        data = json.loads((dst / LAYOUT_FILE).read_text())
        assert layout.distinct_only and data["version"] == 2 and data["slices"] == "distinct"
        every, once = _layout_bytes(layout)
        written, data_bytes = _bytes(dst)
        with capsys.disabled():
            print(
                f"\nhf-to-ms {' '.join(flags)}: rank files {written} bytes ({data_bytes} of tensor data; the HF "
                f"model file {model_bytes}); by the layout, every rank storing its slices: {every} bytes of data, "
                f"each distinct slice once: {once}"
            )
        assert data_bytes == once  # was `every`: dp4 wrote 4 copies of every replicated slice
        # every rank's slices, read through the owners' files, are the whole tensors' slices
        src = open_checkpoint(dst).model
        whole = open_checkpoint(tmp_path / "hf").model
        for rank in range(layout.world_size):
            got = load_rank(src, layout, rank)
            for name, value in got.items():
                np.testing.assert_array_equal(value, whole.read(name, layout.slice_of(name, rank)))
        # merging gives the same HF folder as the whole conversion path
        assert cli.main(["convert", "ms-to-hf", str(dst), str(dst) + "_hf", "--no-progress"]) == 0
        if flags == ["--dp", "4"]:
            assert cli.main(["convert", "hf-to-ms", str(tmp_path / "hf"), str(tmp_path / "ms"), "--no-progress"]) == 0
            assert (
                cli.main(["convert", "ms-to-hf", str(tmp_path / "ms"), str(tmp_path / "ms_hf"), "--no-progress"]) == 0
            )
        names = sorted(p.name for p in (tmp_path / "ms_hf").iterdir())
        _, mismatch, errors = filecmp.cmpfiles(tmp_path / "ms_hf", str(dst) + "_hf", names, shallow=False)
        assert mismatch == [] and errors == []


def test_version_1_folders_still_read(tmp_path):
    """A folder written the old way (every rank stores all its slices, version 1) opens, checks and reads."""
    cfg = small_config()
    write_random_checkpoint(tmp_path / "hf", cfg, dtype="float32", seed=6)
    whole = open_checkpoint(tmp_path / "hf")
    par = ParallelConfig(dp=2, tp=2, micro_batches=1)
    layout = build_layout(cfg, par, dtypes={n: "F32" for n in build_layout(cfg, par).tensors})
    old = tmp_path / "old"
    for rank in range(layout.world_size):
        (old / rank_dir_name(rank)).mkdir(parents=True)
        write_file(
            old / rank_dir_name(rank) / "model.safetensors",
            rank_entries(whole.model, layout, rank),
            {"format": "ms"},
            fsync=False,
        )
    layout.write(old / LAYOUT_FILE)
    (old / "config.json").write_bytes((tmp_path / "hf" / "config.json").read_bytes())
    assert json.loads((old / LAYOUT_FILE).read_text())["version"] == 1
    assert len(load_file(str(old / "rank_00003" / "model.safetensors"))) == len(layout.tensors_of_rank(3))
    src = open_checkpoint(old).model
    assert not src.layout.distinct_only
    for name in layout.tensors:
        full = tuple((0, d) for d in layout.tensors[name].shape)
        if layout.tensors[name].experts is not None:
            continue
        np.testing.assert_array_equal(src.read(name, full), whole.model.read(name, full))


def test_v2_lora_16npu_bytes_by_the_layout():
    """The recipe's layout (the 236B base in bf16): what pre-sharding it writes, before and now."""
    recipe_path = REPO_RECIPES / "v2-lora-16npu.yaml"
    recipe = load_recipe(recipe_path, (), planning_config_path(recipe_path))
    cfg = DeepseekV2Config.from_json(REPO_RECIPES / "v2-lora-16npu.config.json")
    names = build_layout(cfg, recipe.parallel).tensors
    layout = build_layout(cfg, recipe.parallel, dtypes={n: "BF16" for n in names})  # the base model, bf16
    every, once = _layout_bytes(layout)
    print(
        f"\nv2-lora-16npu base pre-sharded ({layout.describe()}): every rank storing its slices "
        f"{every / 1e9:.1f} GB, each distinct slice once {once / 1e9:.1f} GB ({every / once:.2f}x)"
    )
    assert once < every
