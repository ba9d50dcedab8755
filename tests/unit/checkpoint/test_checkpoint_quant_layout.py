"""Per-rank slices of a quantized base (``convert quantize``) under tp / ep layouts.

``build_layout(..., quant=)`` gives each quantized tensor's slice: the stored weight (int8, or int4
packed two per byte) split like the float weight, the scale / offset [.., out, in/G] like its ``out``
axis and, group-wise, its ``in`` axis on the groups. Checked against MindSpore's own loader
(``mindspore.parallel._tensor._load_tensor_by_layout``) cutting the whole tensor, and read from the
whole quantized folder by the same ``load_rank`` the float checkpoints use.
"""

import numpy as np
import pytest

from ms_deepseek.checkpoint.layout import build_layout
from ms_deepseek.checkpoint.slice_readers import full_slice
from ms_deepseek.config.parallel import ParallelConfig
from ms_deepseek.config.quant import QuantSpec
from ms_deepseek.core.errors import UserError

from builders import small_config

LAYOUTS = [ParallelConfig(dp=2, ep=2), ParallelConfig(dp=1, tp=2), ParallelConfig(dp=2, tp=2, ep=2)]
SPECS = [QuantSpec(bits=8, group_size=None), QuantSpec(bits=4, group_size=8)]


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    from ms_deepseek.checkpoint.convert.quantize import quantize_checkpoint
    from ms_deepseek.checkpoint.convert.synthetic import write_random_checkpoint

    root = tmp_path_factory.mktemp("qlayout")
    write_random_checkpoint(root / "hf", small_config(), dtype="float32", layout="hf", seed=3)
    out = {}
    for spec in SPECS:
        dst = root / f"int{spec.bits}"
        quantize_checkpoint(root / "hf", dst, spec.bits, spec.group_size, progress=False, fsync=False)
        out[spec.bits] = dst
    return out


@pytest.mark.parametrize("par", LAYOUTS, ids=lambda p: p.describe())
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"int{s.bits}")
def test_each_rank_reads_the_slice_mindspores_loader_cuts(quantized, spec, par):
    import mindspore as ms
    import mindspore.parallel._tensor as ms_tensor

    from ms_deepseek.checkpoint.convert.sharded import load_rank
    from ms_deepseek.checkpoint.opener import open_checkpoint

    cfg = small_config()
    opened = open_checkpoint(quantized[spec.bits])
    layout = build_layout(cfg, par, quant=spec)
    quant_names = [n for n in layout.tensors if n.endswith((".weight_scale", ".weight_offset"))]
    assert quant_names and set(layout.tensors) == set(_stored_names(opened.model, cfg))
    split_in = [n for n in quant_names if layout.tensors[n].split[-1] > 1]
    if spec.group_size and par.tp > 1:
        assert split_in, "no scale splits its groups axis in this layout"
    whole = {n: opened.model.read(n, full_slice(t.shape, t.experts is not None)) for n, t in layout.tensors.items()}
    for rank in range(layout.world_size):
        got = load_rank(opened.model, layout, rank)
        for name, t in layout.tensors.items():
            entry = (list(t.dev_matrix), list(t.tensor_map), list(t.slice_shape()), 0, 1, "", list(t.shape))
            want = ms_tensor._load_tensor_by_layout(ms.Tensor(whole[name]), entry, rank).asnumpy()
            assert got[name].dtype == whole[name].dtype, name
            np.testing.assert_array_equal(got[name], want, err_msg=f"{name} rank {rank}")


def _stored_names(src, cfg):
    from ms_deepseek.config import names

    out = set()
    for n in src.tensors:
        out.add(names.hf_to_ms(n)[0])
    return out


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"int{s.bits}")
def test_the_plans_scale_layouts_agree_with_the_checkpoint_layout(spec):
    """parallel_plan/styles.py's weight_scale / weight_offset layouts (what apply_plan checks) split each scale as
    layout.json does."""
    from ms_deepseek.parallel_plan.plan import Plan
    from ms_deepseek.parallel_plan.styles import Mesh, fit_layout

    cfg, par = small_config(), ParallelConfig(dp=2, tp=2, ep=2)
    layout, plan, mesh = build_layout(cfg, par, quant=spec), Plan(), Mesh.from_parallel(par)
    for name, t in layout.tensors.items():
        if name.endswith((".weight_scale", ".weight_offset")):
            assert fit_layout(t.shape, plan.param_layout(name, mesh)[1]) == t.split, name


def test_a_split_that_cuts_a_scale_group_or_an_int4_byte_is_refused():
    # the dense down_proj [32, 48] split 4 ways on in: 12 columns per rank, groups of 8
    with pytest.raises(
        UserError,
        match=r"down_proj\.weight: a 4-way split of its input width \d+ .* cuts a scale "
        r"group of 8 columns",
    ):
        build_layout(small_config(), ParallelConfig(dp=1, tp=4), quant=QuantSpec(bits=4, group_size=8))
    # int4 per channel, in = 18 split 2 ways: 9 columns per rank, an odd count of nibbles
    with pytest.raises(UserError, match=r"down_proj\.weight: a 2-way split of its input width 18 .* cuts a byte"):
        build_layout(
            small_config(moe_intermediate_size=18), ParallelConfig(dp=1, tp=2), quant=QuantSpec(bits=4, group_size=None)
        )
    # int8 per channel: any split of in is fine (the scale is per output row)
    build_layout(small_config(), ParallelConfig(dp=1, tp=4), quant=QuantSpec(bits=8, group_size=None))


@pytest.mark.parametrize("flags", [["--dp", "2", "--ep", "2"], ["--tp", "2"]], ids=" ".join)
def test_presharded_quantize_merges_back_to_the_whole_quantized_output(tmp_path, quantized, flags):
    """``convert quantize --dp/--tp/--ep``: every tensor of the rank folders, put together, has the bytes of
    the whole ``convert quantize`` output; the folder opens as a quantized sharded base."""
    from ms_deepseek.checkpoint.opener import open_checkpoint
    from ms_deepseek.cli import main

    src = quantized[4].parent / "hf"
    dst = tmp_path / "sharded"
    assert (
        main(
            [
                "convert",
                "quantize",
                str(src),
                str(dst),
                "--bits",
                "4",
                "--group-size",
                "8",
                "--no-progress",
                "--no-fsync",
            ]
            + flags
        )
        == 0
    )
    assert sorted(p.name for p in dst.glob("rank_*")) == ["rank_00000", "rank_00001"]
    sharded, whole = open_checkpoint(dst), open_checkpoint(quantized[4])
    assert sharded.kind == "sharded" and sharded.quant == whole.quant
    layout = sharded.model.layout
    for name, t in layout.tensors.items():
        sl = full_slice(t.shape, t.experts is not None)
        got, want = sharded.model.read(name, sl), whole.model.read(name, sl)
        assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), name
    assert any(
        layout.tensors[n].split != (1,) * len(layout.tensors[n].shape)
        for n in layout.tensors
        if n.endswith(".weight_scale")
    )


def test_presharded_quantize_refuses_a_split_that_cuts_a_scale_group(tmp_path, quantized):
    from builders import main_captured

    src = quantized[4].parent / "hf"
    code, _out, err = main_captured(
        [
            "convert",
            "quantize",
            str(src),
            str(tmp_path / "out"),
            "--bits",
            "4",
            "--group-size",
            "8",
            "--tp",
            "4",
            "--no-progress",
        ]
    )
    assert code != 0 and "cuts a scale group of 8 columns" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()
