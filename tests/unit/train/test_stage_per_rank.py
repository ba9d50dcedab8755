"""One pipeline stage per rank: the trainer's own init, load and save touch only this rank's stage
(as MindSpore's Cell.init_parameters_data initialises only parallel_parameter_name_list). The rank is
emulated on CPU: a Trainer holding a lazily built, plan-applied tiny model for global rank 2 of
dp1 tp2 pp2 (stage 1); the save's barrier (an AllReduce) is emulated as a no-op."""

from types import SimpleNamespace

from safetensors import safe_open

from ms_deepseek.checkpoint.layout import build_layout
from ms_deepseek.config.model import get_preset
from ms_deepseek.config.parallel import ParallelConfig

from builders import attach_save_state

TINY = get_preset("tiny")
PAR = ParallelConfig(dp=1, tp=2, pp=2, micro_batches=2)
RANK = 2  # stage 1


def _trainer(tmp_path, lazy=True, weights=None):
    from mindspore.nn.utils import no_init_parameters

    from ms_deepseek.checkpoint.tensors import model_tensors
    from ms_deepseek.model.causal_lm import DeepseekV2ForCausalLM
    from ms_deepseek.parallel_apply.apply import apply_plan
    from ms_deepseek.train.trainer import Trainer

    if lazy:
        with no_init_parameters():
            model = DeepseekV2ForCausalLM(TINY)
    else:
        model = DeepseekV2ForCausalLM(TINY)
    t = object.__new__(Trainer)
    t.cfg, t.par, t.rank, t.world, t.sharded = TINY, PAR, RANK, PAR.world_size, True
    t.model, t.applied, t.opt_shards = model, apply_plan(model, PAR, TINY), None
    t.recipe = SimpleNamespace(
        weights_folder=weights,
        lora=None,
        global_batch_size=2,
        checkpoint=SimpleNamespace(save_interval=1, save_final=True),
        to_yaml=lambda: "model: {source: tiny}\n",
    )
    t.model_tensors = model_tensors(model)
    attach_save_state(t, tmp_path)
    return t


def _stages():
    layout = build_layout(TINY, PAR)
    mine = set(layout.tensors_of_rank(RANK))
    return layout, mine, set(layout.tensors) - mine


def test_random_init_materialises_only_this_stage(tmp_path):
    t = _trainer(tmp_path)
    layout, mine, others = _stages()
    assert mine and others
    t._load_weights_slices(layout, t.model_tensors)
    params = {p.name: p for p in t.model.get_parameters()}
    assert [n for n in mine if params[n].has_init] == []  # this stage: data
    assert sorted(n for n in others if not params[n].has_init) == []  # other stages: never allocated


def test_save_writes_only_this_stages_tensors(tmp_path, monkeypatch):
    import ms_deepseek.checkpoint.training as training

    monkeypatch.setattr(training, "barrier", lambda: None)  # the AllReduce of the other ranks
    t = _trainer(tmp_path, lazy=False)
    _, mine, others = _stages()
    t._maybe_save(1)
    files = list((tmp_path / "checkpoints").glob(".*partial-sharded/rank_00002/model.safetensors"))
    assert len(files) == 1, list((tmp_path / "checkpoints").rglob("*"))
    with safe_open(str(files[0]), "np") as f:
        saved = set(f.keys())
    assert saved == mine, (sorted(saved - mine)[:3], sorted(mine - saved)[:3])
    assert not saved & others
