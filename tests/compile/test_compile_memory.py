"""MindSpore's own device-memory accounting against the planner: ``plan --compile --memory``.

MindSpore's dry run at level 1 (``MS_SIMULATION_LEVEL=1``) compiles a recipe's training step and runs it
once without kernels, accounting every block of its device memory pool (design.md section 8). The
planner's estimate for the same model and layout must agree with MindSpore's peak, on what both count,
within ``TOLERANCE``; a planner that counted the Adam states once instead of twice must not.

A small model keeps it cheap (one level-1 run, about a minute of CPU): 2 layers (a dense one and an MoE
one), so the command compiles one depth only; dp 2, ep 2, optimizer sharding, full recompute and two
accumulation steps, so the parts the planner models at full scale (sharded weights and Adam states,
accumulated gradients, all-gathered weight copies, activations and the loss's backward) are all in the
peak. The vocabulary is wide enough that the parameters, not MindSpore's per-block rounding and small
constants, make most of the peak.
"""

import dataclasses
import json

from builders import main_captured, write_recipe

TOLERANCE = 0.10  # |planner / MindSpore - 1| on what both count (the command's default)

MODEL = {
    "vocab_size": 32768,
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "kv_lora_rank": 64,
    "q_lora_rank": 96,
    "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 32,
    "v_head_dim": 32,
    "max_position_embeddings": 128,
    "capacity_factor": None,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
}


def _recipe(tmp_path):
    data = {
        "model": {"source": "tiny", "overrides": MODEL},
        "data": {"seq_len": 64, "embedded_vocab_size": 32768, "validation": {"fraction": 0.1}},
        "train": {"steps": 3, "micro_batch_size": 1, "grad_accum_steps": 2, "eval_interval": 1},
        "parallel": {"dp": 2, "ep": 2, "optimizer_shard": True, "recompute": "full"},
        "checkpoint": {"save_interval": 0},
        "logging": {"tensorboard": False},
    }
    return write_recipe(tmp_path / "recipe", data)


def test_level1_peak_agrees_with_the_planner_and_a_planted_planner_error_does_not(tmp_path):
    from ms_deepseek.config.recipe import load_recipe
    from ms_deepseek.parallel_plan.planner import check_recipe_fits, default_precision
    from ms_deepseek.verification.compile import memory_accounting as mc

    recipe = _recipe(tmp_path)
    code, out, err = main_captured(
        [
            "plan",
            "--recipe",
            str(recipe),
            "--compile",
            "--memory",
            "--ranks",
            "0",
            "--tolerance",
            str(TOLERANCE),
            "--json",
        ]
    )
    report = json.loads(out)
    [depth] = report["depths"]  # the recipe's own depth: no extrapolation needed
    [rank] = depth["ranks"]
    assert rank["ok"], rank
    rows = {r["row"]: (r["planner_gb"], r["mindspore_gb"]) for r in rank["rows"]}
    assert code == 0 and rank["within_tolerance"], (rank["ratio"], rows, err[-2000:])
    # MindSpore holds Adam's two float32 moments per (optimizer-sharded) element, as the planner counts them
    planner_opt, ms_opt = rows["optimizer states"]
    assert ms_opt > 0 and abs(planner_opt / ms_opt - 1) < 0.02, rows

    # the planted error: the optimizer states counted once (4 bytes per element instead of 8), against the
    # same MindSpore accounting
    loaded = load_recipe(str(recipe), [])
    planted = dataclasses.replace(default_precision(loaded.model_config), optimizer_bytes=4)
    stage = check_recipe_fits(loaded, precision=planted).stages[0]
    wrong = mc.compare(stage, rank["accounting"], rank=0, layers=depth["layers"])
    assert abs(wrong.ratio - 1) > TOLERANCE, (wrong.ratio, rank["ratio"])
