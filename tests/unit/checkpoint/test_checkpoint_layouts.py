"""Checkpoints across layouts: per-rank slices, pre-sharded conversion, merge to HF, resharding,
the lazy build, and every bad sharded input (message, exit code, nothing left behind).

Files are read back with ``safetensors`` (the reference implementation), never with our parser.
"""

import filecmp
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from ms_deepseek import cli
from ms_deepseek.checkpoint.convert.hf import hf_to_ms, ms_to_hf
from ms_deepseek.checkpoint.convert.sharded import check_loader_slices, load_rank, write_sharded, write_whole
from ms_deepseek.checkpoint.convert.synthetic import write_random_checkpoint
from ms_deepseek.checkpoint.layout import ExpertIds, build_layout, read_layout
from ms_deepseek.checkpoint.opener import open_checkpoint
from ms_deepseek.checkpoint.slice_readers import WholeSource
from ms_deepseek.checkpoint.weight_files import read_weight_files
from ms_deepseek.config.inventory import expected_ms_shapes
from ms_deepseek.config.parallel import ParallelConfig
from ms_deepseek.core.errors import UserError

from builders import small_config

# dp, tp, ep, pp all above 1, and a placement that is not contiguous blocks
LAYOUT = ParallelConfig(dp=2, tp=2, pp=2, ep=2, micro_batches=2, expert_placement=[1, 0, 1, 0, 0, 1, 1, 0])
FLAGS = ["--dp", "2", "--tp", "2", "--pp", "2", "--ep", "2"]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """A random HF checkpoint (bf16, 3 files), its whole ms conversion and its HF round trip."""
    root = tmp_path_factory.mktemp("layouts")
    write_random_checkpoint(root / "hf", small_config(), dtype="bfloat16", num_shards=3, seed=3)
    hf_to_ms(root / "hf", root / "ms", progress=False, shard_size="30KB")
    ms_to_hf(root / "ms", root / "hf_whole", progress=False, shard_size="30KB")
    write_sharded(root / "hf", root / "sharded", LAYOUT)
    return root


def full_tensors(folder: Path) -> dict:
    src = WholeSource.of(read_weight_files(folder))
    return {n: src.read(n, tuple((0, d) for d in s)) for n, s in expected_ms_shapes(src.cfg).items()}


def same_folders(a: Path, b: Path) -> None:
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    match, mismatch, errors = filecmp.cmpfiles(a, b, names, shallow=False)
    assert mismatch == [] and errors == [], (mismatch, errors)


def run_cli(argv, capsys):
    code = cli.main(argv)
    return code, capsys.readouterr()


# ---------------------------------------------------------------------------- slices
def test_every_rank_slices_put_together_are_the_full_tensors(pristine):
    """Every virtual rank of dp2 tp2 pp2 ep2 loads its slices (from HF and from ms safetensors); pasted
    back by the layout they are the full tensors, each value exactly once per distinct slice; a rank
    holds only its stage's tensors; experts follow the placement."""
    want = full_tensors(pristine / "ms")
    for folder in ("hf", "ms"):
        src = WholeSource.of(read_weight_files(pristine / folder))
        layout = build_layout(src.cfg, LAYOUT, dtypes={n: src.dtype(n) for n in want})
        rebuilt = {n: np.zeros_like(v) for n, v in want.items()}
        hits = {n: np.zeros(v.shape, np.int64) for n, v in want.items()}
        for rank in range(layout.world_size):
            mine = load_rank(src, layout, rank)
            stage = rank // 4
            assert set(mine) == {n for n, t in layout.tensors.items() if t.stage == stage}
            for name, value in mine.items():
                sl = layout.slice_of(name, rank)
                assert value.shape == layout.tensors[name].slice_shape()
                if isinstance(sl[0], ExpertIds):  # [E_local, out, in] slice: place expert by expert
                    index = np.ix_(*[np.asarray(sl[0])] + [np.arange(a, b) for a, b in sl[1:]])
                else:
                    index = tuple(slice(a, b) for a, b in sl)
                rebuilt[name][index] = value
                hits[name][index] += 1
        for name in want:
            np.testing.assert_array_equal(rebuilt[name], want[name], err_msg=f"{folder}: {name}")
            assert (hits[name] > 0).all(), name
    layout = read_layout(pristine / "sharded")
    experts = layout.tensors["model.layers.1.mlp.experts.up_proj.weight"]
    assert experts.experts == ((1, 3, 4, 7), (0, 2, 5, 6))  # EP rank 0 holds the experts placed on it
    assert layout.slice_of("model.layers.1.mlp.experts.up_proj.weight", 2)[0] == (0, 2, 5, 6)
    assert experts.split == (2, 2, 1)  # experts by ep, the expert intermediate size by tp
    assert layout.tensors["model.layers.3.self_attn.o_proj.weight"].stage == 1
    assert check_loader_slices(small_config(), LAYOUT) == 0.0


def test_loader_check_catches_a_wrong_slice(monkeypatch):
    """The plan --simulate loader check fails when ranks are handed the wrong rows (a part of a tensor no
    rank holds) or when the sliced reader returns other values than the slice."""
    from ms_deepseek.checkpoint import layout as layout_mod
    from ms_deepseek.checkpoint import slice_readers as sources

    real = layout_mod.TensorLayout.slice_of

    def shifted(self, device):
        sl = real(self, device)
        if self.name.endswith("kv_b_proj.weight") and sl[0][0] > 0:
            return ((0, sl[0][1] - sl[0][0]),) + sl[1:]  # tp coordinate 1 reads coordinate 0's rows
        return sl

    with monkeypatch.context() as m:
        m.setattr(layout_mod.TensorLayout, "slice_of", shifted)
        assert check_loader_slices(small_config(), LAYOUT) > 1e-5

    real_read = sources.WholeSource.read

    def off_by_one(self, name, sl):
        if name.endswith("o_proj.weight") and sl[1][0] > 0:  # the second tp half of the input axis
            sl = (sl[0], (sl[1][0] - 1, sl[1][1] - 1)) + tuple(sl[2:])
        return real_read(self, name, sl)

    monkeypatch.setattr(sources.WholeSource, "read", off_by_one)
    assert check_loader_slices(small_config(), LAYOUT) > 1e-5


def test_lazy_build_allocates_nothing_then_takes_a_ranks_slices(pristine):
    """no_init_parameters: no parameter holds data after the build; loading rank 5's slices gives exactly
    those slices to its stage's parameters and leaves the other stage's unallocated."""
    from mindspore.nn.utils import no_init_parameters

    from ms_deepseek.checkpoint.tensors import restore_into
    from ms_deepseek.model.causal_lm import DeepseekV2ForCausalLM

    src = open_checkpoint(pristine / "sharded").model
    cfg = small_config()
    with no_init_parameters():
        model = DeepseekV2ForCausalLM(cfg)
    params = {p.name: p for p in model.get_parameters() if not p.name.endswith("expert_placement")}
    assert all(p.has_init for p in params.values()), "the lazy build allocated parameter data"
    layout = src.layout
    rank = 5
    mine = {n: params[n] for n in layout.tensors_of_rank(rank)}
    restore_into(mine, src, "model", layout=layout, rank=rank)
    want = full_tensors(pristine / "ms")
    for name, param in params.items():
        if name not in mine:
            assert param.has_init, f"{name} (other stage) was allocated"
            continue
        from ms_deepseek.checkpoint.layout import slice_array
        from ms_deepseek.checkpoint.slice_readers import to_float32

        expect = to_float32(slice_array(want[name], layout.slice_of(name, rank)), layout.tensors[name].dtype)
        np.testing.assert_array_equal(param.asnumpy(), expect, err_msg=name)


# ---------------------------------------------------------------------------- conversions
def test_hf_to_per_rank_to_hf_is_byte_identical(pristine, tmp_path, capsys):
    """convert hf-to-ms --dp/--tp/--pp/--ep, then ms-to-hf of the rank folders: the same files, byte for byte,
    as converting the whole checkpoint; safetensors reads every rank file with the layout's slice shapes."""
    code, out = run_cli(
        ["convert", "hf-to-ms", str(pristine / "hf"), str(tmp_path / "sh"), *FLAGS, "--no-progress"], capsys
    )
    assert code == 0, out.err
    assert "8 rank folders" in out.out
    layout = read_layout(tmp_path / "sh")
    assert layout.distinct_only  # each distinct slice once, in its owner's folder
    copies = {}
    for rank in range(8):
        stored = load_file(str(tmp_path / "sh" / f"rank_{rank:05d}" / "model.safetensors"))
        assert {n: v.shape for n, v in stored.items()} == {
            n: layout.tensors[n].slice_shape() for n in layout.stored_in(rank)
        }
        for n in stored:
            copies[(n, layout.slice_of(n, rank))] = copies.get((n, layout.slice_of(n, rank)), 0) + 1
    assert set(copies.values()) == {1}
    assert sorted(copies) == sorted((n, sl) for n in layout.tensors for _, sl in layout.distinct_slices(n))
    code, out = run_cli(
        [
            "convert",
            "ms-to-hf",
            str(tmp_path / "sh"),
            str(tmp_path / "merged"),
            "--no-progress",
            "--shard-size",
            "30KB",
        ],
        capsys,
    )
    assert code == 0, out.err
    same_folders(tmp_path / "merged", pristine / "hf_whole")


def test_recipe_layout_and_reshard_between_layouts(pristine, tmp_path, capsys):
    """--recipe gives the layout; reshard sharded -> other sharded -> whole keeps every tensor's bytes."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "model:\n  source: " + str(pristine / "hf") + "\nparallel:\n  dp: 2\n  tp: 2\n  ep: 2\n"
        "data:\n  seq_len: 16\n  path: " + str(tmp_path / "not-prepared") + "\n"
    )
    code, out = run_cli(
        ["convert", "reshard", str(pristine / "sharded"), str(tmp_path / "dp2tp2"), "--recipe", str(recipe)], capsys
    )
    assert code == 0, out.err
    layout = read_layout(tmp_path / "dp2tp2")
    assert (layout.dp, layout.tp, layout.pp, layout.ep) == (2, 2, 1, 2)
    code, out = run_cli(
        [
            "convert",
            "reshard",
            str(tmp_path / "dp2tp2"),
            str(tmp_path / "whole"),
            "--dp",
            "1",
            "--tp",
            "1",
            "--ep",
            "1",
        ],
        capsys,
    )
    assert code == 0, out.err
    got = load_file(str(tmp_path / "whole" / "model.safetensors"))
    want = full_tensors(pristine / "ms")
    assert set(got) == set(want)
    for name in want:  # safetensors widens nothing: compare the bf16 bit patterns
        assert got[name].view(np.uint16).tobytes() == want[name].tobytes(), name


def test_training_checkpoint_with_optimizer_reshards_and_merges(pristine, tmp_path):
    """A whole training checkpoint (model + optimizer + state) -> sharded -> whole: optimizer states sliced like
    their parameters, scalars on every rank, state.json carried with the new world size, every byte back."""
    from safetensors.numpy import save_file

    step = tmp_path / "step_00000004"
    write_whole(pristine / "ms", step)  # model.safetensors (bf16) + config.json
    rng = np.random.default_rng(0)
    opt = {"global_step": np.array([4], np.int32), "loss_scale": np.array(1.0, np.float32)}
    for n, shape in expected_ms_shapes(small_config()).items():
        opt[f"adam_m.{n}"] = rng.standard_normal(shape).astype(np.float32)
        opt[f"adam_v.{n}"] = rng.random(shape).astype(np.float32)
    save_file(opt, str(step / "optimizer.safetensors"))
    (step / "state.json").write_text(json.dumps({"step": 4, "world_size": 2}))
    (step / "recipe.yaml").write_text("{}\n")

    write_sharded(step, tmp_path / "sharded", LAYOUT)
    layout = read_layout(tmp_path / "sharded")
    assert layout.optimizer["global_step"].stage == -1
    assert layout.optimizer["adam_m.model.layers.1.mlp.experts.down_proj.weight"].experts is not None
    assert json.loads((tmp_path / "sharded" / "state.json").read_text())["world_size"] == 8
    rank3 = load_file(str(tmp_path / "sharded" / "rank_00003" / "optimizer.safetensors"))
    name = "adam_v.model.layers.1.mlp.experts.gate_proj.weight"
    sl = layout.slice_of(name[len("adam_v.") :], 3)
    np.testing.assert_array_equal(rank3[name], opt[name][np.asarray(sl[0])][:, sl[1][0] : sl[1][1]])
    assert "adam_m.model.norm.weight" not in rank3  # stage 0 holds no final norm
    # the scalars every rank holds are stored once, by rank 0 (layout.json "slices": "distinct")
    rank0 = load_file(str(tmp_path / "sharded" / "rank_00000" / "optimizer.safetensors"))
    assert "global_step" in rank0 and "global_step" not in rank3

    write_whole(tmp_path / "sharded", tmp_path / "back")
    back = load_file(str(tmp_path / "back" / "optimizer.safetensors"))
    assert set(back) == set(opt)
    for n in opt:
        np.testing.assert_array_equal(back[n], opt[n], err_msg=n)
    assert filecmp.cmp(tmp_path / "back" / "model.safetensors", step / "model.safetensors", shallow=False)
    assert "world_size" not in json.loads((tmp_path / "back" / "state.json").read_text())


# ---------------------------------------------------------------------------- bad input
def broken_copy(pristine: Path, tmp_path: Path) -> Path:
    src = tmp_path / "src"
    shutil.copytree(pristine / "sharded", src)
    return src


def refuses(capsys, tmp_path, argv, pattern):
    """One line naming the problem, exit 2, nothing at the destination."""
    import re

    dst = tmp_path / "dst"
    code, out = run_cli(argv + [str(dst)] if "reshard" not in argv else argv[:3] + [str(dst)] + argv[3:], capsys)
    assert code == 2, out
    lines = [ln for ln in out.err.splitlines() if ln.strip()]
    assert len(lines) == 1 and re.search(pattern, lines[0]), out.err
    assert "Traceback" not in out.err
    assert not dst.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".dst")] == []


@pytest.mark.parametrize("command", ["ms-to-hf", "reshard"])
def test_missing_rank_folder(pristine, tmp_path, capsys, command):
    src = broken_copy(pristine, tmp_path)
    shutil.rmtree(src / "rank_00006")
    extra = ["--dp", "1"] if command == "reshard" else []
    refuses(capsys, tmp_path, ["convert", command, str(src)] + extra, r"rank_00006: missing rank folder")


def test_rank_folder_of_another_layout(pristine, tmp_path, capsys):
    src = broken_copy(pristine, tmp_path)
    shutil.copytree(src / "rank_00007", src / "rank_00008")
    refuses(capsys, tmp_path, ["convert", "ms-to-hf", str(src)], r"rank_00008: rank folder of another layout")
    # a rank folder holding another layout's slices (a 4-rank tp2 copy dropped in): the shapes give it away
    other = tmp_path / "other"
    write_sharded(pristine / "hf", other, ParallelConfig(dp=1, tp=4, ep=1))
    shutil.rmtree(src / "rank_00008")
    shutil.rmtree(src / "rank_00001")
    shutil.copytree(other / "rank_00001", src / "rank_00001")
    refuses(
        capsys,
        tmp_path,
        ["convert", "ms-to-hf", str(src)],
        r"rank_00001/model\.safetensors: tensor .* the layout file does not match the tensors",
    )


def test_layout_file_not_matching_the_tensors(pristine, tmp_path, capsys):
    src = broken_copy(pristine, tmp_path)
    data = json.loads((src / "layout.json").read_text())
    data["tensors"]["model.norm.weight"]["dtype"] = "F32"
    (src / "layout.json").write_text(json.dumps(data))
    refuses(
        capsys,
        tmp_path,
        ["convert", "ms-to-hf", str(src)],
        r"rank_0000\d/model\.safetensors: tensor model\.norm\.weight is BF16 .* does not match the tensors",
    )
    data["tensors"]["model.norm.weight"]["dtype"] = "BF16"
    data["tensors"]["model.norm.weight"]["shape"] = [31]
    (src / "layout.json").write_text(json.dumps(data))
    refuses(
        capsys,
        tmp_path,
        ["convert", "ms-to-hf", str(src)],
        r"rank_0000\d/model\.safetensors: tensor model\.norm\.weight is BF16 \[32\], layout\.json says BF16 \[31\]",
    )
    (src / "layout.json").write_text('{"format": "ms_deepseek.sharded", "version": 1}')
    refuses(capsys, tmp_path, ["convert", "ms-to-hf", str(src)], r"layout\.json: malformed layout file")
    (src / "layout.json").unlink()
    refuses(capsys, tmp_path, ["convert", "ms-to-hf", str(src)], r"layout\.json: missing")


def test_truncated_slice(pristine, tmp_path, capsys):
    src = broken_copy(pristine, tmp_path)
    path = src / "rank_00002" / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-10])
    refuses(
        capsys,
        tmp_path,
        ["convert", "ms-to-hf", str(src)],
        r"rank_00002/model\.safetensors: truncated safetensors file",
    )


def test_rank_folder_outside_the_checkpoint(pristine, tmp_path, capsys):
    src = broken_copy(pristine, tmp_path)
    outside = tmp_path / "elsewhere"
    shutil.move(str(src / "rank_00004"), str(outside))
    (src / "rank_00004").symlink_to(outside, target_is_directory=True)
    refuses(
        capsys,
        tmp_path,
        ["convert", "ms-to-hf", str(src)],
        r"rank_00004: rank folder lies outside the checkpoint folder",
    )


def test_layout_that_does_not_fit_the_model(pristine, tmp_path, capsys):
    refuses(capsys, tmp_path, ["convert", "hf-to-ms", str(pristine / "hf"), "--tp", "3"], r"parallel\.tp|not divisible")
    with pytest.raises(UserError, match="--set: needs --recipe"):
        from types import SimpleNamespace

        from ms_deepseek.cli.convert import layout_from_args

        layout_from_args(SimpleNamespace(dp=None, tp=None, pp=None, ep=None, recipe=None, overrides=["a.b=1"]))


def test_from_pretrained_reads_a_sharded_checkpoint(pristine):
    """from_pretrained on rank folders gives the same parameters as on the HF folder they came from."""
    from ms_deepseek.model.causal_lm import DeepseekV2ForCausalLM

    a = {
        p.name: p.asnumpy()
        for p in DeepseekV2ForCausalLM.from_pretrained(pristine / "sharded", show_progress=False).get_parameters()
    }
    b = {
        p.name: p.asnumpy()
        for p in DeepseekV2ForCausalLM.from_pretrained(pristine / "hf", show_progress=False).get_parameters()
    }
    assert a.keys() == b.keys()
    for name in b:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def write_strategy(path: Path, entries) -> None:
    """A MindSpore strategy file (the protobuf Ascend runs write) with (name, dev_matrix, tensor_map) entries."""
    from mindspore.train.node_strategy_pb2 import ParallelStrategyMap

    m = ParallelStrategyMap()
    m.current_stage = 0
    for name, dev, tmap in entries:
        item = m.parallel_layout_item.add()
        item.param_name = name
        lay = item.parallel_layouts
        lay.dev_matrix.add().dim.extend(dev)
        lay.tensor_map.add().dim.extend(tmap)
        lay.field, lay.opt_weight_shard_step, lay.opt_weight_shard_size = 0, 0, 0
    path.write_bytes(m.SerializeToString())


def test_strategy_files_must_agree_with_the_layout_file(pristine, tmp_path, capsys):
    """Rank folders carrying MindSpore strategy files merge when they agree with layout.json; a strategy that
    splits a tensor otherwise stops the merge with one line naming the file and the tensor."""
    src = broken_copy(pristine, tmp_path)
    layout = read_layout(src)
    o_proj = "model.layers.0.self_attn.o_proj.weight"
    experts = "model.layers.1.mlp.experts.down_proj.weight"
    for rank in range(layout.world_size):
        write_strategy(
            src / f"rank_{rank:05d}" / "strategy.ckpt",
            [(n, layout.tensors[n].dev_matrix, layout.tensors[n].tensor_map) for n in (o_proj, experts)]
            + [("adam_m." + o_proj, layout.tensors[o_proj].dev_matrix, layout.tensors[o_proj].tensor_map)],
        )
    code, out = run_cli(
        ["convert", "ms-to-hf", str(src), str(tmp_path / "ok"), "--no-progress", "--shard-size", "30KB"], capsys
    )
    assert code == 0, out.err
    same_folders(tmp_path / "ok", pristine / "hf_whole")
    # rank 3 was compiled with o_proj split on its rows instead of its input axis
    write_strategy(src / "rank_00003" / "strategy.ckpt", [(o_proj, (2, 2, 1), (1, -1))])
    refuses(
        capsys,
        tmp_path,
        ["convert", "ms-to-hf", str(src)],
        r"rank_00003/strategy\.ckpt: tensor model\.layers\.0\.self_attn\.o_proj\.weight has dev_matrix "
        r"\[2, 2, 1\] tensor_map \[1, -1\]; layout\.json says",
    )


def test_checkpoints_hold_experts_in_hf_order_whatever_the_placement():
    """A placement permutes the stacked experts into buffer order in the live model; what is saved is in
    expert (HF) order, and restoring a whole checkpoint puts the buffer order back."""
    import mindspore as ms

    from ms_deepseek.checkpoint.slice_readers import WholeSource
    from ms_deepseek.checkpoint.tensors import hf_ordered, model_tensors, restore_into
    from ms_deepseek.model.causal_lm import DeepseekV2ForCausalLM
    from ms_deepseek.parallel_apply.apply import apply_plan

    cfg = small_config()
    ms.set_seed(0)
    model = DeepseekV2ForCausalLM(cfg)
    before = {n: p.asnumpy().copy() for n, p in model_tensors(model).items()}
    applied = apply_plan(model, ParallelConfig(dp=2, ep=2, expert_placement=[1, 0, 1, 0, 0, 1, 1, 0]), cfg)
    name = "model.layers.1.mlp.experts.up_proj.weight"
    live = model_tensors(model)
    assert not np.array_equal(live[name].asnumpy(), before[name])  # buffer order in the model
    saved = hf_ordered(live, applied)
    for n in before:
        np.testing.assert_array_equal(saved[n].asnumpy(), before[n], err_msg=n)

    class Saved(WholeSource):  # the saved tensors as a source, without a file
        def __init__(self):
            self.tensors, self.folder = {}, "saved"

        def has(self, n):
            return n in saved

        def dtype(self, n):
            return "F32"

        def read(self, n, sl):
            return saved[n].asnumpy()[tuple(slice(a, b) for a, b in sl)]

    for p in live.values():
        p.set_data(ms.Tensor(np.zeros(p.shape, np.float32)))
    restore_into(live, Saved(), "model", applied=applied)
    np.testing.assert_array_equal(
        live[name].asnumpy(),
        hf_ordered({name: live[name]}, applied)[name].asnumpy()[applied.expert_orders["model.layers.1.mlp.experts"]],
    )
    np.testing.assert_array_equal(hf_ordered(live, applied)[name].asnumpy(), before[name])
