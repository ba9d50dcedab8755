"""One pipeline stage per rank: the trainer's own init, load and save touch only this rank's stage
(as MindSpore's Cell.init_parameters_data initialises only parallel_parameter_name_list). The rank is
emulated on CPU: the run context and tensors of a lazily built, plan-applied tiny model for global rank 2 of
dp1 tp2 pp2 (stage 1), with the checkpointer over them; the save's barrier (an AllReduce) is emulated as a
no-op."""

from types import SimpleNamespace

from safetensors import safe_open

from ms_deepseek.checkpoint.layout import build_layout
from ms_deepseek.config.model import get_preset
from ms_deepseek.config.parallel import ParallelConfig
from ms_deepseek.train.parallelism import read_weight_slices

from builders import emulated_rank

TINY = get_preset("tiny")
PAR = ParallelConfig(dp=1, tp=2, pp=2, micro_batches=2)
RANK = 2  # stage 1


def _rank(tmp_path, lazy=True, weights=None):
    from mindspore.nn.utils import no_init_parameters

    from ms_deepseek.checkpoint.tensors import model_tensors
    from ms_deepseek.model.causal_lm import DeepseekV2ForCausalLM
    from ms_deepseek.parallel_apply.apply import apply_plan

    if lazy:
        with no_init_parameters():
            model = DeepseekV2ForCausalLM(TINY)
    else:
        model = DeepseekV2ForCausalLM(TINY)
    recipe = SimpleNamespace(
        weights_folder=weights,
        lora=None,
        model_config=TINY,
        parallel=PAR,
        global_batch_size=2,
        to_yaml=lambda: "model: {source: tiny}\n",
    )
    return emulated_rank(recipe, tmp_path, RANK, model, apply_plan(model, PAR, TINY), model_tensors(model))


def _stages():
    layout = build_layout(TINY, PAR)
    mine = set(layout.tensors_of_rank(RANK))
    return layout, mine, set(layout.tensors) - mine


def test_random_init_materialises_only_this_stage(tmp_path):
    r = _rank(tmp_path)
    layout, mine, others = _stages()
    assert mine and others
    read_weight_slices(r.ctx, r.tensors, layout, r.tensors.model_tensors)
    params = {p.name: p for p in r.tensors.model.get_parameters()}
    assert [n for n in mine if params[n].has_init] == []  # this stage: data
    assert sorted(n for n in others if not params[n].has_init) == []  # other stages: never allocated


def test_save_writes_only_this_stages_tensors(tmp_path, monkeypatch):
    import ms_deepseek.checkpoint.training as training

    monkeypatch.setattr(training, "barrier", lambda: None)  # the AllReduce of the other ranks
    r = _rank(tmp_path, lazy=False)
    _, mine, others = _stages()
    r.checkpointer.save(1)
    files = list((tmp_path / "checkpoints").glob(".*partial-sharded/rank_00002/model.safetensors"))
    assert len(files) == 1, list((tmp_path / "checkpoints").rglob("*"))
    with safe_open(str(files[0]), "np") as f:
        saved = set(f.keys())
    assert saved == mine, (sorted(saved - mine)[:3], sorted(mine - saved)[:3])
    assert not saved & others
