"""Smoke training run for ``ms-deepseek doctor``: the tiny preset, shrunk further, trains
``--steps`` optimizer steps on one fixed random batch; the loss must fall.

The step is the project's own: ``train.step.build_step`` (forward, backward, clipping)
with ``train.optim.build_optimizer`` (our AdamW, constant lr), in graph mode (what Ascend
runs), so the smoke run exercises the code a real run uses. Prints one JSON line:
``{"device", "mode", "steps", "losses", "seconds", "params"}`` (or ``{"error": ...}``).
Run it alone with ``python -m ms_deepseek.doctor.smoke``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time


def smoke_config():
    """The ``tiny`` preset made smaller still: two layers (one dense, one MoE with 4 experts)."""
    from ms_deepseek.config.model import get_preset

    cfg = get_preset("tiny")
    return dataclasses.replace(
        cfg,
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        n_routed_experts=4,
        n_shared_experts=1,
        n_group=2,
        topk_group=1,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        kv_lora_rank=32,
        q_lora_rank=48,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        max_position_embeddings=64,
        compute_dtype="float32",
        param_dtype="float32",
    )


def pick_device(requested: str) -> str:
    if requested != "auto":
        return requested
    from ms_deepseek.core.runtime import detect_device

    return detect_device()


def train(
    steps: int = 10, device: str = "auto", seq_len: int = 32, batch: int = 2, lr: float = 3e-3, seed: int = 0
) -> dict:
    import mindspore as ms
    import numpy as np

    from ms_deepseek import DeepseekV2ForCausalLM
    from ms_deepseek.config.parallel import ParallelConfig
    from ms_deepseek.config.recipe import OptimSection, TrainSection
    from ms_deepseek.core.runtime import use_device
    from ms_deepseek.train.optim import build_optimizer
    from ms_deepseek.train.step import build_step

    device = use_device(pick_device(device))
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_seed(seed)
    cfg = smoke_config()
    model = DeepseekV2ForCausalLM(cfg)
    model.set_train(True)
    params = model.trainable_params()
    optimizer = build_optimizer(params, OptimSection(lr=lr, schedule="constant", weight_decay=0.0), steps)
    step, _ = build_step(model, optimizer, TrainSection(clip_grad_norm=1.0), ParallelConfig())
    rng = np.random.default_rng(seed)
    ids = ms.Tensor(rng.integers(3, cfg.vocab_size, size=(batch, seq_len)), ms.int32)  # [B, T]

    losses = []
    start = time.perf_counter()
    for _ in range(steps):
        outputs = step(ids, ids)[0]  # [total, loss, aux_loss, moe stats...]
        losses.append(float(outputs.asnumpy()[1]))  # host read: waits for the step
    return {
        "device": device,
        "mode": "graph",
        "steps": steps,
        "losses": losses,
        "seconds": time.perf_counter() - start,
        "params": int(sum(p.size for p in params)),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="tiny-model smoke training run (doctor:smoke_train)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--device", choices=["auto", "CPU", "Ascend"], default="auto")
    parser.add_argument("--json", action="store_true", help="print only the JSON result line")
    args = parser.parse_args(argv)
    if args.steps < 2:
        print(json.dumps({"error": f"--steps must be >= 2, got {args.steps}"}))
        return 2
    from ms_deepseek.core.runtime import quiet_defaults

    quiet_defaults()
    try:
        report = train(args.steps, args.device)
    except Exception as exc:  # noqa: BLE001 - the doctor reports the one-line cause
        first_line = (str(exc).strip().splitlines() or [""])[0]
        print(json.dumps({"error": f"{type(exc).__name__}: {first_line}"}))
        return 1
    if not args.json:
        for i, loss in enumerate(report["losses"]):
            print(f"step {i + 1:3d}  loss {loss:.4f}")
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
