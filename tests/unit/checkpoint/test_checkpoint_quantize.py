"""``convert quantize``: the int8 / int4 arithmetic, the checkpoint format, and its refusals."""

import json

import numpy as np
import pytest
from safetensors.numpy import load_file

from ms_deepseek.checkpoint.convert.quant_format import (
    dequantize_array,
    is_quantized_weight,
    pack_int4,
    quantize_array,
    unpack_int4,
)
from ms_deepseek.cli import main


def _within_half_a_scale(err, scale, w):
    """err <= scale / 2, up to the float32 rounding of the product q * scale (half an ulp of the result)."""
    return (err <= scale / 2 + np.spacing(np.abs(w).astype(np.float32))).all()


SMALL = dict(num_hidden_layers=2, vocab_size=512, max_position_embeddings=64)


@pytest.fixture(scope="module")
def hf_base(tmp_path_factory):
    from ms_deepseek.checkpoint.convert.synthetic import write_random_checkpoint
    from ms_deepseek.config.model import get_preset

    folder = tmp_path_factory.mktemp("base") / "hf"
    write_random_checkpoint(folder, get_preset("tiny", **SMALL), dtype="float32")
    return folder


def test_int8_per_channel_dequantisation_error_is_at_most_half_a_scale():
    w = np.random.default_rng(0).standard_normal((64, 96)).astype(np.float32) * 0.05
    w[3] = 0.0  # an all-zero row: scale 1, exact zeros
    q, scale = quantize_array(w, 8, None)
    assert q.dtype == np.int8 and scale.shape == (64, 1) and np.abs(q).max() <= 127
    err = np.abs(dequantize_array(q, scale, 8) - w)
    assert _within_half_a_scale(err, scale, w), (err / scale).max()
    assert (dequantize_array(q, scale, 8)[3] == 0).all()
    # group-wise int4 obeys the same bound with its own scales
    q4, s4 = quantize_array(w, 4, 32)
    assert s4.shape == (64, 3) and np.abs(q4).max() <= 7
    err4 = np.abs(dequantize_array(pack_int4(q4), s4, 4) - w).reshape(64, 3, 32)
    assert _within_half_a_scale(err4, s4[..., None], w.reshape(64, 3, 32))


def test_int4_packing_round_trips_exactly():
    values = np.arange(-8, 8, dtype=np.int8)
    q = np.random.default_rng(1).choice(values, size=(5, 7, 64)).astype(np.int8)
    packed = pack_int4(q)
    assert packed.dtype == np.uint8 and packed.shape == (5, 7, 32)
    np.testing.assert_array_equal(unpack_int4(packed), q)
    # the documented nibble order: column 0 in the low nibble, column 1 in the high one
    assert pack_int4(np.array([[-1, 2]], np.int8))[0, 0] == 0x2F


def test_which_tensors_are_quantized():
    assert is_quantized_weight("model.layers.0.self_attn.q_a_proj.weight")
    assert is_quantized_weight("model.layers.1.mlp.experts.3.down_proj.weight")
    assert is_quantized_weight("model.layers.1.mlp.experts.down_proj.weight")  # stacked
    for name in (
        "lm_head.weight",
        "model.embed_tokens.weight",
        "model.layers.1.mlp.gate.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.self_attn.kv_a_layernorm.weight",
    ):
        assert not is_quantized_weight(name), name


@pytest.mark.parametrize("bits,group", [(8, None), (4, 32)])
def test_quantize_writes_the_documented_format(hf_base, tmp_path, bits, group):
    from ms_deepseek.checkpoint.opener import open_checkpoint

    out = tmp_path / "q"
    argv = ["convert", "quantize", str(hf_base), str(out), "--bits", str(bits), "--no-progress"]
    assert main(argv + (["--group-size", str(group)] if group else [])) == 0
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert cfg == {
        "quant_method": "ms_deepseek",
        "bits": bits,
        "group_size": group,
        "symmetric": True,
        "original": str(hf_base.resolve()),
    }
    desc = json.loads((out / "quant_model_description.json").read_text())
    assert desc["model_quant_type"] == f"W{bits}A16" and desc["lm_head.weight"] == "FLOAT"
    got, src = load_file(str(out / "model.safetensors")), load_file(str(hf_base / "model.safetensors"))
    quantized = [n for n in src if is_quantized_weight(n)]
    assert any(".experts.0." in n for n in quantized) and len(quantized) > 10
    for name, value in src.items():
        if name not in quantized:
            np.testing.assert_array_equal(got[name], value, err_msg=name)  # bytes unchanged
            continue
        stem = name[: -len(".weight")]
        w, scale = value.astype(np.float32), got[stem + ".weight_scale"]
        q = got[name]
        assert q.dtype == (np.int8 if bits == 8 else np.uint8)
        assert q.shape == (w.shape[0], w.shape[1] if bits == 8 else w.shape[1] // 2)
        assert scale.dtype == np.float32 and scale.shape == (w.shape[0], w.shape[1] // (group or w.shape[1]))
        assert (got[stem + ".weight_offset"] == 0).all()
        err = np.abs(dequantize_array(q, scale, bits) - w).reshape(w.shape[0], scale.shape[1], -1)
        assert _within_half_a_scale(err, scale[..., None], w.reshape(err.shape)), name
    opened = open_checkpoint(out)
    assert (opened.kind, opened.quant.bits, opened.quant.group_size) == ("hf", bits, group)


def test_quantize_an_ms_layout_folder_keeps_stacked_experts(hf_base, tmp_path):
    ms_dir, out = tmp_path / "ms", tmp_path / "q"
    assert main(["convert", "hf-to-ms", str(hf_base), str(ms_dir), "--no-progress"]) == 0
    assert main(["convert", "quantize", str(ms_dir), str(out), "--bits", "4", "--no-progress"]) == 0
    got = load_file(str(out / "model.safetensors"))
    q = got["model.layers.1.mlp.experts.gate_proj.weight"]
    scale = got["model.layers.1.mlp.experts.gate_proj.weight_scale"]
    assert q.dtype == np.uint8 and q.ndim == 3 and scale.shape == q.shape[:2] + (1,)


@pytest.mark.parametrize("case", ["already", "bits", "group", "odd_group"])
def test_bad_quantize_input_is_one_line_and_leaves_nothing(hf_base, tmp_path, capsys, case):
    dst = tmp_path / "out"
    src = hf_base
    extra = ["--bits", "8"]
    if case == "already":
        src = tmp_path / "q8"
        assert main(["convert", "quantize", str(hf_base), str(src), "--bits", "8", "--no-progress"]) == 0
        capsys.readouterr()
    elif case == "bits":
        extra = ["--bits", "3"]
    elif case == "group":
        extra = ["--bits", "4", "--group-size", "100"]  # does not divide 192
    else:
        extra = ["--bits", "4", "--group-size", "3"]  # divides 192 but int4 pairs columns
    with pytest.raises(SystemExit) if case == "bits" else _nothing() as raised:
        code = main(["convert", "quantize", str(src), str(dst), "--no-progress"] + extra)
    code = raised.value.code if case == "bits" else code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "Traceback" not in "\n".join(err)
    assert len(err) == 1 or case == "bits"  # argparse prints its usage above the one error line
    line = err[-1]
    want = {
        "already": "already quantized",
        "bits": "invalid choice: 3",
        "group": "group size 100 does not divide",
        "odd_group": "group size must be even",
    }[case]
    assert want in line, line
    assert not dst.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
