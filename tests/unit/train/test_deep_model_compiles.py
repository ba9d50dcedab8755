"""A model deeper than ~16 decoder layers compiles: MindSpore's graph compiler refuses a graph whose calls
nest past its recursion limit (1000 by default, "Exceed function call depth limit"), and the training step
nests with depth, so V2-Lite (27 layers) and V2 (60) could not have been trained. Found by MindSpore's dry run
at 16 layers; :func:`ms_deepseek.core.runtime.allow_graph_depth` raises the limit from the layer count.
MindSpore is the oracle: with the limit left at its default (planted) the same step is refused."""

import pytest

from builders import SMALL_MODEL, main_captured, write_recipe

pytestmark = pytest.mark.slow  # a deep model's compile, minutes: the full tier

LAYERS = 17  # 16 already fails at MindSpore's default


def _recipe(tmp_path):
    data = {
        "model": {"source": "tiny", "overrides": dict(SMALL_MODEL, num_hidden_layers=LAYERS)},
        "data": {"seq_len": 16, "embedded_vocab_size": 512},
        "train": {"steps": 1, "micro_batch_size": 1, "seed": 5, "eval_interval": 0},
        "optim": {"lr": 1e-3, "warmup_steps": 0},
        "checkpoint": {"save_interval": 0},
        "logging": {"log_interval": 1, "tensorboard": False},
    }
    return write_recipe(tmp_path / "recipe", data)


@pytest.mark.parametrize("planted", [False, True], ids=["limit-from-layers", "planted-default-limit"])
def test_a_model_past_sixteen_layers_compiles_its_training_step(tmp_path, monkeypatch, planted):
    import mindspore as ms

    from ms_deepseek.train import build

    if planted:
        monkeypatch.setattr(build, "allow_graph_depth", lambda layers: ms.set_recursion_limit(1000))
    argv = ["train", str(_recipe(tmp_path)), "--output", str(tmp_path / "run")]
    try:
        if planted:
            with pytest.raises(RuntimeError, match="Exceed function call depth limit"):
                main_captured(argv)
            return
        code, out, err = main_captured(argv)
    finally:
        ms.set_recursion_limit(1000)  # the process-wide setting back to MindSpore's default
    assert code == 0, (out + err)[-3000:]
    assert "step 1/1" in out + err, (out + err)[-2000:]
