"""Bad input to the converter: one-line UserError naming the file and tensor, non-zero CLI exit, and nothing
left behind (no destination, no temporary folder)."""

import functools
import json
import shutil
import struct
from pathlib import Path

import pytest

from ms_deepseek import cli
from ms_deepseek.checkpoint.convert import hf as api
from ms_deepseek.checkpoint.convert.hf import hf_to_ms, ms_to_hf
from ms_deepseek.checkpoint.convert.synthetic import write_random_checkpoint
from ms_deepseek.core.errors import UserError

from builders import small_config as builders_small_config

INDEX = "model.safetensors.index.json"
# 3 layers, 2 heads, 4 routed experts, no q compression
small_config = functools.partial(
    builders_small_config, num_hidden_layers=3, num_attention_heads=2, n_routed_experts=4, q_lora_rank=None
)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    root = tmp_path_factory.mktemp("pristine")
    write_random_checkpoint(root / "sharded", small_config(), dtype="float32", num_shards=3, seed=1)
    write_random_checkpoint(root / "single", small_config(), dtype="bfloat16", num_shards=1, seed=2)
    hf_to_ms(root / "single", root / "ms", progress=False)
    return root


@pytest.fixture
def sharded(pristine, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(pristine / "sharded", src)
    return src


@pytest.fixture
def single(pristine, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(pristine / "single", src)
    return src


def header_of(path: Path) -> dict:
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8 : 8 + n])


def rewrite(path: Path, header: dict, data: bytes) -> None:
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def data_of(path: Path) -> bytes:
    raw = path.read_bytes()
    return raw[8 + struct.unpack("<Q", raw[:8])[0] :]


def fails(src: Path, dst: Path, pattern: str, direction=hf_to_ms) -> str:
    """The conversion fails with a one-line UserError matching ``pattern``; nothing is left at DST."""
    with pytest.raises(UserError, match=pattern) as info:
        direction(src, dst, progress=False, workers=2)
    message = str(info.value)
    assert "\n" not in message
    assert not dst.exists()
    assert [p.name for p in dst.parent.iterdir() if p.name.startswith(f".{dst.name}.")] == []
    return message


def cli_fails(direction: str, src: Path, dst: Path, capsys, pattern: str) -> None:
    rc = cli.main(["convert", direction, str(src), str(dst), "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err and pattern in err, err
    assert not dst.exists()


# ------------------------------------------------------------------ damaged files
def test_truncated_shard(sharded, tmp_path, capsys):
    shard = sharded / "model-00002-of-00003.safetensors"
    last = max(header_of(shard).items(), key=lambda kv: kv[1]["data_offsets"][1] if kv[0] != "__metadata__" else 0)[0]
    shard.write_bytes(shard.read_bytes()[:-10])
    msg = fails(sharded, tmp_path / "dst", r"model-00002-of-00003\.safetensors: truncated safetensors file: tensor ")
    assert last in msg
    cli_fails("hf-to-ms", sharded, tmp_path / "dst", capsys, "truncated safetensors file")


def test_file_cut_inside_the_header(single, tmp_path):
    path = single / "model.safetensors"
    path.write_bytes(path.read_bytes()[:100])
    fails(
        single,
        tmp_path / "dst",
        r"model\.safetensors: truncated safetensors file \(header of \d+ bytes, "
        r"file holds 100 bytes\)",
    )
    path.write_bytes(b"\x01\x02")
    fails(single, tmp_path / "dst", r"model\.safetensors: truncated or not a safetensors file \(2 bytes")


def test_corrupt_header(single, tmp_path):
    path = single / "model.safetensors"
    raw = bytearray(path.read_bytes())
    raw[8:12] = b"\xff\xfe{["
    path.write_bytes(bytes(raw))
    fails(single, tmp_path / "dst", r"model\.safetensors: corrupt safetensors header \(not JSON")
    path.write_bytes(struct.pack("<Q", 2**40) + b"{}")
    fails(single, tmp_path / "dst", r"model\.safetensors: corrupt safetensors header \(header length")


def test_wrong_offsets_and_sizes(single, tmp_path):
    path = single / "model.safetensors"
    header, data = header_of(path), data_of(path)
    name = "model.layers.0.mlp.up_proj.weight"
    good = json.loads(json.dumps(header))
    header[name]["shape"] = [48, 31]
    rewrite(path, header, data)
    fails(
        single,
        tmp_path / "dst",
        rf"model\.safetensors: corrupt safetensors header: tensor {name}: \d+ bytes in "
        r"data_offsets, dtype BF16 x shape \[48, 31\] needs",
    )
    header = json.loads(json.dumps(good))
    header[name]["dtype"] = "Q9"
    rewrite(path, header, data)
    fails(single, tmp_path / "dst", rf"tensor {name}: unknown dtype 'Q9'")
    rewrite(path, good, data + b"\0" * 16)
    fails(single, tmp_path / "dst", r"model\.safetensors: corrupt safetensors file: 16 bytes after the last tensor")
    header = json.loads(json.dumps(good))
    s, e = header[name]["data_offsets"]
    header[name]["data_offsets"] = [s + 2, e + 2]  # overlaps the next tensor
    rewrite(path, header, data)
    fails(single, tmp_path / "dst", r"corrupt safetensors header: tensor .* (overlaps|gap)")


# ------------------------------------------------------------------ the index
def test_index_names_a_missing_file(sharded, tmp_path, capsys):
    (sharded / "model-00003-of-00003.safetensors").unlink()
    fails(
        sharded,
        tmp_path / "dst",
        r"model\.safetensors\.index\.json: weight_map\['.*'\] names "
        r"'model-00003-of-00003\.safetensors', which is missing",
    )
    cli_fails("hf-to-ms", sharded, tmp_path / "dst", capsys, "which is missing")


@pytest.mark.parametrize("target", ["../outside.safetensors", "sub/../../outside.safetensors", "ABS"])
def test_index_path_traversal(sharded, tmp_path, target):
    outside = tmp_path / "outside.safetensors"
    shutil.copyfile(sharded / "model-00001-of-00003.safetensors", outside)  # exists: refused for where it is
    if target == "ABS":
        target = str(outside)
    index = json.loads((sharded / INDEX).read_text())
    name = next(iter(index["weight_map"]))
    index["weight_map"][name] = target
    (sharded / INDEX).write_text(json.dumps(index))
    fails(
        sharded,
        tmp_path / "dst",
        rf"{INDEX}: weight_map\['{name}'\] = '.*outside\.safetensors' lies outside "
        "the checkpoint folder",
    )


def test_index_disagrees_with_files(sharded, tmp_path):
    index = json.loads((sharded / INDEX).read_text())
    wm = index["weight_map"]
    name = next(n for n, f in wm.items() if f == "model-00001-of-00003.safetensors")
    wm[name] = "model-00002-of-00003.safetensors"
    (sharded / INDEX).write_text(json.dumps(index))
    fails(
        sharded,
        tmp_path / "dst",
        rf"{INDEX}: tensor {name} is mapped to model-00002-of-00003\.safetensors, "
        "which does not hold it",
    )
    del wm[name]
    (sharded / INDEX).write_text(json.dumps(index))
    fails(sharded, tmp_path / "dst", rf"model-00001-of-00003\.safetensors: tensor {name} is not listed")
    (sharded / INDEX).write_text('{"weight_map": [1, 2]}')
    fails(sharded, tmp_path / "dst", rf"{INDEX}: no 'weight_map' object")


# ------------------------------------------------------------------ tensors against config.json
def test_missing_tensor(single, tmp_path):
    path = single / "model.safetensors"
    header, data = header_of(path), data_of(path)
    name = "model.layers.2.mlp.experts.3.down_proj.weight"
    s, e = header.pop(name)["data_offsets"]
    for v in header.values():
        if isinstance(v, dict) and "data_offsets" in v and v["data_offsets"][0] >= e:
            v["data_offsets"] = [v["data_offsets"][0] - (e - s), v["data_offsets"][1] - (e - s)]
    rewrite(path, header, data[:s] + data[e:])
    fails(
        single,
        tmp_path / "dst",
        rf"model\.safetensors: missing tensor {name} \(required by config\.json in the "
        "HuggingFace layout\\)",
    )


def test_unexpected_tensor(sharded, tmp_path):
    path = sharded / "model-00003-of-00003.safetensors"
    header, data = header_of(path), data_of(path)
    header["model.layers.1.self_attn.q_proj.bias"] = {
        "dtype": "F32",
        "shape": [2],
        "data_offsets": [len(data), len(data) + 8],
    }
    rewrite(path, header, data + b"\0" * 8)
    index = json.loads((sharded / INDEX).read_text())
    index["weight_map"]["model.layers.1.self_attn.q_proj.bias"] = path.name
    (sharded / INDEX).write_text(json.dumps(index))
    fails(
        sharded,
        tmp_path / "dst",
        r"model-00003-of-00003\.safetensors: unexpected tensor "
        r"model\.layers\.1\.self_attn\.q_proj\.bias \(not in the HuggingFace layout",
    )


def test_shape_contradicts_config(single, tmp_path, capsys):
    cfg = json.loads((single / "config.json").read_text())
    cfg["moe_intermediate_size"] = 20
    (single / "config.json").write_text(json.dumps(cfg))
    fails(
        single,
        tmp_path / "dst",
        r"model\.safetensors: tensor model\.layers\.1\.mlp\.experts\.0\.gate_proj\.weight "
        r"has shape \[16, 32\], .*config\.json implies \[20, 32\]",
    )
    cfg["moe_intermediate_size"] = 16
    cfg["q_lora_rank"] = 8  # q compression: q_proj is unexpected
    (single / "config.json").write_text(json.dumps(cfg))
    fails(single, tmp_path / "dst", r"unexpected tensor model\.layers\.0\.self_attn\.q_proj\.weight \(and 2 more\)")
    cfg["q_lora_rank"] = None
    cfg["tie_word_embeddings"] = True  # then lm_head.weight is unexpected
    (single / "config.json").write_text(json.dumps(cfg))
    cli_fails("hf-to-ms", single, tmp_path / "dst", capsys, "unexpected tensor lm_head.weight")


def test_mixed_expert_dtypes(tmp_path):
    cfg = small_config()
    write_random_checkpoint(
        tmp_path / "src",
        cfg,
        dtype="bfloat16",
        seed=3,
        dtype_overrides={"model.layers.2.mlp.experts.1.up_proj.weight": "float32"},
    )
    fails(
        tmp_path / "src",
        tmp_path / "dst",
        r"model\.safetensors: tensor model\.layers\.2\.mlp\.experts\.1\.up_proj"
        r"\.weight is F32 but model\.layers\.2\.mlp\.experts\.0\.up_proj\.weight "
        r"\(model\.safetensors\) is BF16: the experts of one layer must share",
    )


def test_integer_weights(single, tmp_path):
    path = single / "model.safetensors"
    header = header_of(path)
    header["model.norm.weight"]["dtype"] = "I16"
    rewrite(path, header, data_of(path))
    fails(single, tmp_path / "dst", r"model\.safetensors: tensor model\.norm\.weight has dtype I16; weights must be")


# ------------------------------------------------------------------ not a checkpoint / wrong direction
def test_not_a_checkpoint(single, tmp_path, capsys):
    fails(tmp_path / "nowhere", tmp_path / "dst", r"nowhere: no such folder")
    fails(single / "model.safetensors", tmp_path / "dst", r"model\.safetensors: not a checkpoint folder")
    (tmp_path / "empty").mkdir()
    fails(tmp_path / "empty", tmp_path / "dst", r"empty: not a checkpoint \(no config\.json\)")
    (tmp_path / "conly").mkdir()
    shutil.copyfile(single / "config.json", tmp_path / "conly" / "config.json")
    fails(
        tmp_path / "conly",
        tmp_path / "dst",
        r"conly: not a checkpoint \(no model\.safetensors\.index\.json or "
        r"model\.safetensors\)",
    )
    cfg = json.loads((single / "config.json").read_text())
    cfg["model_type"] = "llama"
    (single / "config.json").write_text(json.dumps(cfg))
    fails(single, tmp_path / "dst", r"config\.json: model_type 'llama' is not 'deepseek_v2'")
    (single / "config.json").write_text("[not json")
    cli_fails("hf-to-ms", single, tmp_path / "dst", capsys, "config.json: not a readable JSON config")


def test_wrong_direction(pristine, tmp_path):
    fails(
        pristine / "ms",
        tmp_path / "dst",
        r"unexpected tensor model\.layers\.1\.mlp\.experts\.down_proj\.weight .*"
        "looks like an ms_deepseek checkpoint: use ms-to-hf",
    )
    fails(
        pristine / "single",
        tmp_path / "dst",
        r"unexpected tensor model\.layers\.1\.mlp\.experts\.0\.down_proj.*"
        "looks like a HuggingFace checkpoint: use hf-to-ms",
        ms_to_hf,
    )


def test_ms_side_shape_checked(pristine, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(pristine / "ms", src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["moe_intermediate_size"] = 20
    (src / "config.json").write_text(json.dumps(cfg))
    fails(
        src,
        tmp_path / "dst",
        r"model-00001-of-00001\.safetensors: tensor model\.layers\.1\.mlp\.experts\."
        r"gate_proj\.weight has shape \[4, 16, 32\], .*implies \[4, 20, 32\]",
        ms_to_hf,
    )


# ------------------------------------------------------------------ failures while writing
def test_failure_while_writing_leaves_nothing(pristine, tmp_path, monkeypatch):
    calls = []
    real = api.write_file

    def flaky(path, tensors, metadata, on_bytes, fsync):
        calls.append(path.name)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real(path, tensors, metadata, on_bytes=on_bytes, fsync=fsync)

    monkeypatch.setattr(api, "write_file", flaky)
    dst = tmp_path / "dst"
    with pytest.raises(OSError, match="No space left"):
        hf_to_ms(pristine / "sharded", dst, shard_size="10KB", workers=2, progress=False)
    assert not dst.exists() and list(tmp_path.iterdir()) == []
    # an existing destination survives a failed --overwrite untouched
    dst.mkdir()
    (dst / "keep.txt").write_text("precious")
    calls.clear()
    with pytest.raises(OSError, match="No space left"):
        hf_to_ms(pristine / "sharded", dst, shard_size="10KB", workers=1, overwrite=True, progress=False)
    assert [p.name for p in tmp_path.iterdir()] == ["dst"] and [p.name for p in dst.iterdir()] == ["keep.txt"]


def test_source_shrinking_during_copy_is_reported(pristine, tmp_path, monkeypatch):
    src = tmp_path / "src"
    shutil.copytree(pristine / "single", src)
    real = api.read_weight_files

    def then_truncate(folder):
        ckpt = real(folder)  # headers checked while the file was whole ...
        path = src / "model.safetensors"
        path.write_bytes(path.read_bytes()[:-4096])  # ... then it loses its tail
        return ckpt

    monkeypatch.setattr(api, "read_weight_files", then_truncate)
    fails(src, tmp_path / "dst", r"model\.safetensors: tensor .* ends early")
