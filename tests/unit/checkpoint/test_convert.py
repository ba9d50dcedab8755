"""HuggingFace <-> ms_deepseek conversion: byte-exact round trips, the files MindSpore and safetensors read,
sharding, workers, destinations, the CLI, and the expected-tensor table.

Files are read back with ``safetensors.deserialize`` (the reference implementation, raw bytes, any dtype),
never with the converter's own parser.
"""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import safetensors

from ms_deepseek import cli
from ms_deepseek.checkpoint.convert.hf import hf_to_ms, ms_to_hf, parse_size
from ms_deepseek.checkpoint.convert.synthetic import write_random_checkpoint
from ms_deepseek.config.inventory import count_parameters, expected_hf_shapes, expected_ms_shapes, zero_width_shapes
from ms_deepseek.config.model import DeepseekV2Config, get_preset
from ms_deepseek.core.errors import UserError

from repo_paths import FIXTURES, REPO

VARIANTS = ("lite", "v2", "lite_yarn", "v2_yarn", "yarn_mscale")


def read_all(folder: Path) -> dict:
    """name -> (dtype, shape, bytes) over every safetensors file of ``folder``; checks the index if any."""
    out = {}
    index = folder / "model.safetensors.index.json"
    if index.exists():
        files = sorted({folder / f for f in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = [folder / "model.safetensors"]
    for path in files:
        for name, t in safetensors.deserialize(path.read_bytes()):
            assert name not in out, f"{name} in two files"
            out[name] = (t["dtype"], tuple(t["shape"]), bytes(t["data"]))
    if index.exists():
        data = json.loads(index.read_text())
        assert set(data["weight_map"]) == set(out)
        assert data["metadata"]["total_size"] == sum(len(v[2]) for v in out.values())
        for name, fname in data["weight_map"].items():
            assert name in {n for n, _ in safetensors.deserialize((folder / fname).read_bytes())}
    return out


def leftovers(dst: Path) -> list:
    return sorted(p.name for p in dst.parent.iterdir() if p.name.startswith(f".{dst.name}."))


def check_stacked(hf: dict, ms: dict, cfg: DeepseekV2Config) -> None:
    """The ms layout holds every HF tensor; stacked experts are the per-expert bytes back to back."""
    assert set(ms) == set(expected_ms_shapes(cfg))
    for name, (dtype, shape, data) in ms.items():
        if ".mlp.experts." in name:
            layer, proj = name.split(".mlp.experts.")
            parts = [hf[f"{layer}.mlp.experts.{e}.{proj}"] for e in range(cfg.n_routed_experts)]
            assert shape == (cfg.n_routed_experts,) + parts[0][1]
            assert all(p[0] == dtype for p in parts)
            assert data == b"".join(p[2] for p in parts)
        else:
            assert (dtype, shape, data) == hf[name]


# ------------------------------------------------------------------ fixture variants
@pytest.mark.parametrize("variant", VARIANTS)
def test_fixture_round_trip_is_byte_exact(variant, tmp_path):
    src = FIXTURES / variant
    cfg = DeepseekV2Config.from_json(src / "config.json")
    res = hf_to_ms(src, tmp_path / "ms", shard_size="200KB", workers=2, progress=False)
    assert len(res.files) > 1
    ms_to_hf(tmp_path / "ms", tmp_path / "hf", shard_size="300KB", workers=3, progress=False)
    hf = read_all(src)
    ms = read_all(tmp_path / "ms")
    check_stacked(hf, ms, cfg)
    back = read_all(tmp_path / "hf")
    assert back == hf
    # config.json is carried verbatim into the ms layout, rewritten in release format on the way back
    assert (tmp_path / "ms" / "config.json").read_bytes() == (src / "config.json").read_bytes()
    assert DeepseekV2Config.from_json(tmp_path / "hf" / "config.json") == cfg
    gen = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert gen["bos_token_id"] == cfg.bos_token_id and gen["eos_token_id"] == cfg.eos_token_id


# ------------------------------------------------------------------ a bfloat16 checkpoint, every layout option
def odd_config(**over) -> DeepseekV2Config:
    """q compression + attention bias + tied embeddings + MoE every second layer + a dense first layer."""
    values = dict(
        vocab_size=96,
        hidden_size=40,
        intermediate_size=56,
        moe_intermediate_size=24,
        num_hidden_layers=5,
        num_attention_heads=2,
        n_routed_experts=6,
        n_shared_experts=2,
        num_experts_per_tok=2,
        topk_method="greedy",
        n_group=1,
        topk_group=1,
        kv_lora_rank=16,
        q_lora_rank=24,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=12,
        moe_layer_freq=2,
        first_k_dense_replace=1,
        attention_bias=True,
        tie_word_embeddings=True,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
    )
    values.update(over)
    return DeepseekV2Config(**values)


@pytest.fixture(scope="module")
def bf16_pair(tmp_path_factory):
    """A bf16 HF checkpoint (router kept in float32, as some exports do) and its ms conversion."""
    root = tmp_path_factory.mktemp("bf16")
    cfg = odd_config()
    routers = {f"model.layers.{i}.mlp.gate.weight": "float32" for i in cfg.moe_layer_indices}
    write_random_checkpoint(root / "hf", cfg, dtype="bfloat16", num_shards=3, seed=7, dtype_overrides=routers)
    hf_to_ms(root / "hf", root / "ms", shard_size="20KB", workers=3, progress=False)
    return cfg, root


def test_bf16_round_trip_is_byte_exact(bf16_pair, tmp_path):
    cfg, root = bf16_pair
    hf = read_all(root / "hf")
    assert {v[0] for v in hf.values()} == {"BF16", "F32"}
    assert set(hf) == set(expected_hf_shapes(cfg))
    assert "lm_head.weight" not in hf and "model.layers.1.self_attn.o_proj.bias" in hf
    ms = read_all(root / "ms")
    check_stacked(hf, ms, cfg)
    ms_to_hf(root / "ms", tmp_path / "back", shard_size="1MB", progress=False)
    assert read_all(tmp_path / "back") == hf
    assert json.loads((tmp_path / "back" / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_output_headers_are_aligned_and_tagged(bf16_pair):
    _, root = bf16_pair
    for path in sorted((root / "ms").glob("*.safetensors")):
        raw = path.read_bytes()
        n = int.from_bytes(raw[:8], "little")
        assert n % 8 == 0
        header = json.loads(raw[8 : 8 + n])
        assert header.pop("__metadata__") == {"format": "ms"}
        offsets = [v["data_offsets"] for v in header.values()]
        assert offsets == sorted(offsets)  # MindSpore's reader needs the entries in data order
        for v in header.values():
            assert (8 + n + v["data_offsets"][0]) % {"F32": 4, "BF16": 2}[v["dtype"]] == 0


def test_shard_size_bounds_every_file_but_oversized_tensors(bf16_pair, tmp_path):
    _, root = bf16_pair
    limit = 12_000
    res = hf_to_ms(root / "hf", tmp_path / "ms", shard_size=limit, workers=1, progress=False)
    assert len(res.files) == len(list((tmp_path / "ms").glob("model-*-of-*.safetensors"))) > 3
    for path in (tmp_path / "ms").glob("*.safetensors"):
        tensors = safetensors.deserialize(path.read_bytes())
        data = sum(len(t["data"]) for _, t in tensors)
        assert data <= limit or len(tensors) == 1
    assert read_all(tmp_path / "ms") == read_all(root / "ms")  # workers and shard size do not change bytes


@pytest.mark.parametrize("how", ["env", "EXDEV"])
def test_buffered_copy_fallback(bf16_pair, tmp_path, monkeypatch, how):
    """Where copy_file_range is refused (another filesystem, old kernel) or disabled, pread/pwrite gives the same."""
    import errno
    import os

    _, root = bf16_pair
    calls = []
    if how == "env":
        monkeypatch.setenv("MS_DEEPSEEK_NO_COPY_FILE_RANGE", "1")
        monkeypatch.setattr(os, "copy_file_range", lambda *a: calls.append(a) or 1 / 0)
    else:
        monkeypatch.delenv("MS_DEEPSEEK_NO_COPY_FILE_RANGE", raising=False)

        def refuse(*args):
            calls.append(args)
            raise OSError(errno.EXDEV, "Invalid cross-device link")

        monkeypatch.setattr(os, "copy_file_range", refuse)
    hf_to_ms(root / "hf", tmp_path / "ms", shard_size="30KB", workers=2, progress=False)
    assert read_all(tmp_path / "ms") == read_all(root / "ms")
    assert (len(calls) == 0) if how == "env" else (len(calls) >= 1)


def test_zero_width_shared_experts_are_carried(tmp_path):
    """n_shared_experts: 0 checkpoints from the reference code hold [0, H] / [H, 0] shared experts; keep them."""
    from safetensors.numpy import load_file, save_file

    cfg = odd_config(n_shared_experts=0)
    write_random_checkpoint(tmp_path / "plain", cfg, dtype="float32", seed=5)
    tensors = load_file(str(tmp_path / "plain" / "model.safetensors"))
    zero = zero_width_shapes(cfg)
    assert zero["model.layers.2.mlp.shared_experts.down_proj.weight"] == (40, 0)
    tensors.update({name: np.zeros(shape, np.float32) for name, shape in zero.items()})
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_bytes((tmp_path / "plain" / "config.json").read_bytes())
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    hf_to_ms(src, tmp_path / "ms", progress=False)
    assert set(zero) <= set(read_all(tmp_path / "ms"))
    ms_to_hf(tmp_path / "ms", tmp_path / "back", progress=False)
    assert read_all(tmp_path / "back") == read_all(src)
    hf_to_ms(tmp_path / "plain", tmp_path / "ms_plain", progress=False)  # without them is fine too
    assert not set(zero) & set(read_all(tmp_path / "ms_plain"))


# ------------------------------------------------------------------ readers: safetensors and MindSpore
def test_safe_open_reads_converted_files(tmp_path):
    src = FIXTURES / "v2"
    hf_to_ms(src, tmp_path / "ms", shard_size="200KB", progress=False)
    cfg = DeepseekV2Config.from_json(src / "config.json")
    seen = {}
    for path in sorted((tmp_path / "ms").glob("*.safetensors")):
        with safetensors.safe_open(str(path), framework="numpy") as f:
            assert f.metadata() == {"format": "ms"}
            for name in f.keys():
                seen[name] = f.get_tensor(name)
    assert {k: v.shape for k, v in seen.items()} == expected_ms_shapes(cfg)
    hf = {}
    for path in sorted(src.glob("*.safetensors")):
        with safetensors.safe_open(str(path), framework="numpy") as f:
            hf.update({k: f.get_tensor(k) for k in f.keys()})
    name = "model.layers.2.mlp.experts.down_proj.weight"
    np.testing.assert_array_equal(seen[name][5], hf["model.layers.2.mlp.experts.5.down_proj.weight"])


def test_mindspore_loads_converted_files_and_trainer_checkpoints_convert_back(bf16_pair, tmp_path):
    import mindspore as ms

    cfg, root = bf16_pair
    hf = read_all(root / "hf")
    params = {}
    for path in sorted((root / "ms").glob("model-*.safetensors")):
        params.update(ms.load_checkpoint(str(path), format="safetensors"))
    assert set(params) == set(expected_ms_shapes(cfg))
    name = "model.layers.2.mlp.experts.up_proj.weight"
    assert params[name].dtype == ms.bfloat16 and tuple(params[name].shape) == expected_ms_shapes(cfg)[name]
    raw = params[name].asnumpy().view(np.uint16)[4].tobytes()
    assert raw == hf["model.layers.2.mlp.experts.4.up_proj.weight"][2]
    assert params["model.layers.4.mlp.gate.weight"].dtype == ms.float32

    # a training checkpoint as the trainer writes it: MindSpore's own safetensors writer, extra files
    step = tmp_path / "checkpoints" / "step_00000010"
    step.mkdir(parents=True)
    for i in cfg.moe_layer_indices:  # non-weight model state the trainer's save_checkpoint(model) also writes
        params[f"model.layers.{i}.mlp.expert_placement"] = ms.Parameter(
            ms.Tensor(np.zeros((cfg.n_routed_experts, 2), np.int32)), requires_grad=False
        )
    ms.save_checkpoint(params, str(step / "model.safetensors"), format="safetensors")
    ms.save_checkpoint(
        {"adam_m.x": ms.Parameter(ms.Tensor(np.ones(3, np.float32)))},
        str(step / "optimizer.safetensors"),
        format="safetensors",
    )
    cfg.save(step / "config.json")
    (step / "state.json").write_text('{"step": 10}\n')
    (step / "recipe.yaml").write_text("model: tiny\n")
    ms_to_hf(step, tmp_path / "hf", progress=False)
    assert read_all(tmp_path / "hf") == hf  # expert_placement and optimizer state dropped
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == [
        "config.json",
        "generation_config.json",
        "model-00001-of-00001.safetensors",
        "model.safetensors.index.json",
    ]
    params["model.layers.2.mlp.expert_placement"] = ms.Parameter(ms.Tensor(np.zeros((5, 2), np.int32)))
    ms.save_checkpoint(params, str(step / "model.safetensors"), format="safetensors")
    with pytest.raises(
        UserError,
        match=r"model\.safetensors: tensor model\.layers\.2\.mlp\.expert_placement has "
        r"shape \[5, 2\], .*config\.json implies \[6, 2\]",
    ):
        ms_to_hf(step, tmp_path / "hf2", progress=False)


# ------------------------------------------------------------------ destination handling
def test_destination_rules(bf16_pair, tmp_path):
    _, root = bf16_pair
    dst = tmp_path / "out"
    dst.mkdir()  # an existing empty folder is fine
    hf_to_ms(root / "hf", dst, progress=False)
    first = read_all(dst)
    with pytest.raises(UserError, match=r"out: destination exists and is not empty \(pass --overwrite"):
        hf_to_ms(root / "hf", dst, progress=False)
    (dst / "stale.txt").write_text("old")
    hf_to_ms(root / "hf", dst, overwrite=True, shard_size="30KB", progress=False)
    assert not (dst / "stale.txt").exists() and read_all(dst) == first
    assert leftovers(dst) == []
    with pytest.raises(UserError, match="the destination is the source"):
        hf_to_ms(root / "hf", root / "hf", overwrite=True, progress=False)
    with pytest.raises(UserError, match="destination holds the source"):
        hf_to_ms(root / "hf", root, overwrite=True, progress=False)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(UserError, match="afile: destination exists and is not a folder"):
        hf_to_ms(root / "hf", tmp_path / "afile", overwrite=True, progress=False)


def test_tokenizer_files_are_carried_along(bf16_pair, tmp_path):
    _, root = bf16_pair
    src = tmp_path / "src"
    src.mkdir()
    for p in (root / "hf").iterdir():
        (src / p.name).symlink_to(p)  # HuggingFace's cache keeps files as symlinks into blobs/
    (src / "tokenizer.json").write_text('{"version": "1.0"}')
    (src / "tokenizer_config.json").write_text("{}")
    (src / "generation_config.json").write_text('{"temperature": 0.3}')
    (src / "notes.txt").write_text("not carried")
    hf_to_ms(src, tmp_path / "ms", progress=False)
    ms_to_hf(tmp_path / "ms", tmp_path / "hf", progress=False)
    for folder in ("ms", "hf"):
        names = {p.name for p in (tmp_path / folder).iterdir()}
        assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= names
        assert "notes.txt" not in names
    assert json.loads((tmp_path / "hf" / "generation_config.json").read_text()) == {"temperature": 0.3}


# ------------------------------------------------------------------ CLI
def test_cli_both_directions(bf16_pair, tmp_path, capsys):
    _, root = bf16_pair
    rc = cli.main(
        [
            "convert",
            "hf-to-ms",
            str(root / "hf"),
            str(tmp_path / "ms"),
            "--workers",
            "2",
            "--shard-size",
            "25KB",
            "--no-progress",
        ]
    )
    assert rc == 0
    assert "hf-to-ms: wrote" in capsys.readouterr().out
    assert read_all(tmp_path / "ms") == read_all(root / "ms")
    rc = cli.main(["convert", "ms-to-hf", str(tmp_path / "ms"), str(tmp_path / "hf"), "--no-progress"])
    assert rc == 0 and read_all(tmp_path / "hf") == read_all(root / "hf")
    rc = cli.main(["convert", "ms-to-hf", str(tmp_path / "ms"), str(tmp_path / "hf"), "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.count("\n") == 0 and "destination exists and is not empty" in err
    rc = cli.main(["convert", "hf-to-ms", str(root / "hf"), str(tmp_path / "x"), "--shard-size", "lots"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "--shard-size 'lots'" in err and not (tmp_path / "x").exists()


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("2GiB") == 2 * 2**30
    assert parse_size("1.5mb") == 1_500_000
    assert parse_size("4096") == 4096 and parse_size(77) == 77
    for bad in ("0", "-1GB", "5 parsecs", "", True):
        with pytest.raises(UserError, match="--shard-size"):
            parse_size(bad)


# ------------------------------------------------------------------ the expected-tensor table
@pytest.mark.parametrize("preset", ["deepseek-v2", "deepseek-v2-lite", "tiny"])
def test_expected_shapes_count_every_parameter(preset):
    cfg = get_preset(preset)
    total = count_parameters(cfg).total
    for table in (expected_hf_shapes(cfg), expected_ms_shapes(cfg)):
        assert sum(math.prod(s) for s in table.values()) == total
    if preset == "deepseek-v2":
        hf = expected_hf_shapes(cfg)
        assert len(hf) == 1 + 59 * (160 * 3 + 13) + 12 + 2  # embed, MoE layers, dense layer 0, norm + head
        assert hf["model.layers.1.self_attn.q_b_proj.weight"] == (128 * 192, 1536)
        assert hf["model.layers.1.mlp.shared_experts.down_proj.weight"] == (5120, 2 * 1536)
        assert expected_ms_shapes(cfg)["model.layers.59.mlp.experts.gate_proj.weight"] == (160, 1536, 5120)


def test_layout_module_imports_without_mindspore():
    import subprocess
    import sys

    code = (
        "import sys, ms_deepseek.config.inventory, ms_deepseek.config.names, ms_deepseek.checkpoint.convert.hf; "
        "assert 'mindspore' not in sys.modules and 'numpy' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)
