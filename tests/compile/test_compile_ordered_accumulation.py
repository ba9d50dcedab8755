"""One NPU, two accumulation micro-steps: MindSpore's level-1 accounting holds one micro-step's loss tensors.

Without MindSpore's accumulation pass (one NPU, plain data parallel) the step's micro-steps run through
``train/step.py`` ``OrderedAccumulation``: each micro-step's input waits on the previous one's gradients.
``GradAccumulation``'s unrolled sum let MindSpore's scheduler run both micro-steps' loss backwards together
(level 1 of v2-lite-lora-1npu: two [n, V] float32 ``Exp`` at the peak). A wide vocabulary makes the loss's
[n, V] float32 tensors the largest blocks, so the peak is in a loss's backward; MindSpore's per-block dump
says how many micro-steps' ``Exp`` are alive there.
"""

import json

from builders import SMALL_MODEL, main_captured, write_recipe

VOCAB, SEQ = 65536, 256

# a small model whose loss tensors ([SEQ, VOCAB] float32) are the largest blocks
MODEL = dict(SMALL_MODEL, vocab_size=VOCAB, max_position_embeddings=SEQ)


def test_one_npu_accumulation_holds_one_micro_steps_loss_tensors(tmp_path):
    data = {
        "model": {"source": "tiny", "overrides": MODEL},
        "data": {"seq_len": SEQ, "embedded_vocab_size": VOCAB},
        "train": {"steps": 2, "micro_batch_size": 1, "grad_accum_steps": 2},
        "parallel": {"dp": 1, "recompute": "full"},
        "checkpoint": {"save_interval": 0},
        "logging": {"tensorboard": False},
    }
    recipe = write_recipe(tmp_path / "recipe", data)
    code, out, err = main_captured(
        ["plan", "--recipe", str(recipe), "--compile", "--memory", "--ranks", "0", "--no-eval", "--json"]
    )
    report = json.loads(out)
    [depth] = report["depths"]
    [rank] = depth["ranks"]
    assert rank["ok"], (rank, err[-2000:])
    loss = [b for b in rank["accounting"]["largest_at_peak"] if b["name"] in ("Exp", "GatherDGradV2")]
    exp_bytes = SEQ * VOCAB * 4
    by_name = {b["name"]: b for b in loss}
    assert "Exp" in by_name, rank["accounting"]["largest_at_peak"]  # the peak is in a loss's backward
    # one micro-step's float32 exp(logits - max) and GatherD gradient, not two
    for name, block in by_name.items():
        assert block["blocks"] == 1 and abs(block["mb"] * 2**20 - exp_bytes) < 2**20, (name, block)
