"""A sharded (tp / ep) QLoRA run's frozen base, on emulated ranks.

As tests/unit/train/test_stage_per_rank.py does: the run context and tensors of a lazily built, plan-applied
model of one global rank (no compile: the parameters keep their full shapes and take their slices as data).
The run's own path builds the quantized placeholders (lora_run.prepare, sharded) and reads the rank's
slices (``LoraModel.load_slices``). Each rank's quantized parameters must equal what MindSpore's own
loader (``mindspore.parallel._tensor._load_tensor_by_layout``) cuts from the whole quantized checkpoint,
bit for bit, whether model.source is the quantized folder or the float one (quantized per rank); the
LoRA checkpoint a rank saves holds only adapters (and routers).
"""

from types import SimpleNamespace

import numpy as np
import pytest
from safetensors import safe_open

from ms_deepseek.config.lora import LoraSpec
from ms_deepseek.config.parallel import ParallelConfig
from ms_deepseek.config.quant import QuantSpec
from ms_deepseek.core.errors import UserError

from builders import emulated_rank, small_config

CFG = small_config(num_hidden_layers=2)
LORA = LoraSpec(
    r=4, alpha=8, target_modules=["q_b_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], train_router=True
)
INT4 = QuantSpec(bits=4, group_size=8)
LAYOUTS = [ParallelConfig(dp=2, ep=2), ParallelConfig(dp=1, tp=2)]


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    from ms_deepseek.checkpoint.convert.quantize import quantize_checkpoint
    from ms_deepseek.checkpoint.convert.synthetic import write_random_checkpoint

    root = tmp_path_factory.mktemp("qbase")
    write_random_checkpoint(root / "hf", CFG, dtype="bfloat16", layout="hf", seed=4)
    quantize_checkpoint(root / "hf", root / "int4", INT4.bits, INT4.group_size, progress=False, fsync=False)
    return {"float": root / "hf", "quantized": root / "int4"}


def _rank(tmp_path, par, rank, source, quant=INT4):
    from mindspore.nn.utils import no_init_parameters

    from ms_deepseek.model.causal_lm import DeepseekV2ForCausalLM
    from ms_deepseek.model.lora import trainable_tensors as lora_checkpoint_tensors
    from ms_deepseek.parallel_apply.apply import apply_plan
    from ms_deepseek.train import lora_run

    with no_init_parameters():
        model = DeepseekV2ForCausalLM(CFG)
    recipe = SimpleNamespace(
        weights_folder=source,
        model_config=CFG,
        parallel=par,
        lora=LORA,
        quant=quant,
        global_batch_size=2,
        train=SimpleNamespace(seed=0),
        checkpoint=SimpleNamespace(save_interval=1, save_final=True),
        to_yaml=lambda: "model: {source: tiny}\n",
    )
    lora_run.prepare(model, recipe, tmp_path, write_base=False, base=source, sharded=True)
    return emulated_rank(recipe, tmp_path, rank, model, apply_plan(model, par, CFG), lora_checkpoint_tensors(model))


def load_base(r):
    """The converter's own read of this rank's slices of the frozen base, as before a sharded run's step 1."""
    from ms_deepseek.train.lora_run import LoraModel

    LoraModel().load_slices(r.ctx, r.tensors, None, fresh=True)


def _whole(folder, layout):
    from ms_deepseek.checkpoint.opener import open_checkpoint
    from ms_deepseek.checkpoint.slice_readers import full_slice

    src = open_checkpoint(folder).model
    return {n: src.read(n, full_slice(t.shape, t.experts is not None)) for n, t in layout.tensors.items()}


@pytest.mark.parametrize("source", ["quantized", "float"])
@pytest.mark.parametrize("par", LAYOUTS, ids=lambda p: p.describe())
def test_each_rank_loads_its_slices_of_the_quantized_base(tmp_path, bases, par, source, monkeypatch):
    import mindspore as ms
    import mindspore.parallel._tensor as ms_tensor

    import ms_deepseek.checkpoint.training as training
    from ms_deepseek.checkpoint.layout import build_layout

    monkeypatch.setattr(training, "barrier", lambda: None)  # the AllReduce of the other ranks
    layout = build_layout(CFG, par, quant=INT4)
    whole = _whole(bases["quantized"], layout)
    quantized = [
        n for n in layout.tensors if n.endswith((".weight_scale", ".weight_offset")) or whole[n].dtype == np.uint8
    ]
    assert quantized
    lora_layout = build_layout(CFG, par, lora=LORA)
    for rank in range(par.world_size):
        r = _rank(tmp_path / f"{source}{rank}", par, rank, bases[source])
        load_base(r)
        params = {p.name: p for p in r.tensors.model.get_parameters()}
        for name in layout.tensors:
            lay = layout.tensors[name]
            entry = (list(lay.dev_matrix), list(lay.tensor_map), list(lay.slice_shape()), 0, 1, "", list(lay.shape))
            want = ms_tensor._load_tensor_by_layout(ms.Tensor(whole[name]), entry, rank).asnumpy()
            got = params[name].asnumpy()
            if name in quantized:
                assert got.dtype == want.dtype and got.shape == lay.slice_shape(), name
                np.testing.assert_array_equal(got, want, err_msg=f"{name} rank {rank}")
            else:  # embeddings, norms, routers, lm_head: bf16 bits widened to float32
                np.testing.assert_array_equal(
                    got,
                    (want.astype(np.uint32) << 16).view(np.float32) if want.dtype == np.uint16 else want,
                    err_msg=name,
                )
        # the LoRA checkpoint this rank saves: adapters and routers, none of the base
        r.checkpointer.save(1)
        files = list((r.ctx.run_dir / "checkpoints").glob(f"*/rank_{rank:05d}/model.safetensors"))
        assert len(files) == 1, files
        with safe_open(str(files[0]), "np") as f:
            saved = set(f.keys())
        assert saved == set(lora_layout.tensors_of_rank(rank))
        assert all(".lora_" in n or n.endswith("mlp.gate.weight") for n in saved), sorted(saved)


def test_a_float_source_whose_split_cuts_scale_groups_is_refused(tmp_path, bases):
    """int8 per channel under tp2: o_proj's input width split in two, its one group per row cut."""
    r = _rank(tmp_path, ParallelConfig(dp=1, tp=2), 0, bases["float"], quant=QuantSpec(bits=8, group_size=None))
    with pytest.raises(
        UserError,
        match=r"o_proj\.weight is split 2 ways on its input width .* run "
        r"`ms-deepseek convert quantize` first",
    ):
        load_base(r)


def test_a_sharded_qlora_run_without_model_source_is_refused(tmp_path):
    with pytest.raises(UserError, match="quant: a tp / pp / ep run reads its frozen base from model.source"):
        _rank(tmp_path, ParallelConfig(dp=1, tp=2), 0, None)
