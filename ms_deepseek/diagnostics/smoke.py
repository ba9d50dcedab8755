"""Smoke training run for ``ms-deepseek doctor``: the tiny preset, shrunk further, trains
``--steps`` optimizer steps on one fixed random batch; the loss must fall.

The step is ``ms.value_and_grad`` + ``nn.AdamWeightDecay`` compiled with ``ms.jit``
(graph mode, what Ascend runs). Prints one JSON line:
``{"device", "mode", "steps", "losses", "seconds", "params"}`` (or ``{"error": ...}``).
Run it alone with ``python -m ms_deepseek.diagnostics.smoke``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import time


def smoke_config():
    """The ``tiny`` preset made smaller still: two layers (one dense, one MoE with 4 experts)."""
    from ms_deepseek.config import get_preset

    cfg = get_preset("tiny")
    return dataclasses.replace(
        cfg, vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4,
        n_shared_experts=1, n_group=2, topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1,
        kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
        max_position_embeddings=64, compute_dtype="float32", param_dtype="float32")


def pick_device(requested: str) -> str:
    if requested != "auto":
        return requested
    has_npu = shutil.which("npu-smi") is not None and bool(os.environ.get("ASCEND_HOME_PATH"))
    return "Ascend" if has_npu else "CPU"


def train(steps: int = 10, device: str = "auto", seq_len: int = 32, batch: int = 2, lr: float = 3e-3,
          seed: int = 0) -> dict:
    import numpy as np
    import mindspore as ms
    from mindspore import nn

    from ms_deepseek import DeepseekV2ForCausalLM

    device = pick_device(device)
    ms.set_device(device)
    ms.set_seed(seed)
    cfg = smoke_config()
    model = DeepseekV2ForCausalLM(cfg)
    params = model.trainable_params()
    optimizer = nn.AdamWeightDecay(params, learning_rate=lr, weight_decay=0.0)
    rng = np.random.default_rng(seed)
    ids = ms.Tensor(rng.integers(3, cfg.vocab_size, size=(batch, seq_len)), ms.int32)  # [B, T]

    def forward(input_ids):
        out = model(input_ids, input_ids)  # (logits, loss, aux_loss, moe_stats)
        return out[1] + out[2], out[1]

    grad_fn = ms.value_and_grad(forward, None, optimizer.parameters, has_aux=True)

    @ms.jit
    def step(input_ids):
        (_, lm_loss), grads = grad_fn(input_ids)
        optimizer(grads)
        return lm_loss

    losses = []
    start = time.perf_counter()
    for _ in range(steps):
        losses.append(float(step(ids).asnumpy()))  # host read: waits for the step
    return {"device": device, "mode": "graph", "steps": steps, "losses": losses,
            "seconds": time.perf_counter() - start, "params": int(sum(p.size for p in params))}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="tiny-model smoke training run (doctor:smoke_train)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--device", choices=["auto", "CPU", "Ascend"], default="auto")
    parser.add_argument("--json", action="store_true", help="print only the JSON result line")
    args = parser.parse_args(argv)
    if args.steps < 2:
        print(json.dumps({"error": f"--steps must be >= 2, got {args.steps}"}))
        return 2
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
