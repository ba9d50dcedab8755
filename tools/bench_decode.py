#!/usr/bin/env python
"""Decode speed with and without the MLA latent KV cache, and the cache sizes of the released models.

    python tools/bench_decode.py                      # tiny preset, random weights, graph and PyNative
    python tools/bench_decode.py --mode graph --prompt-len 128 --new-tokens 128

For each mode, each path (latent cache / full recompute) first runs once to compile and
warm up, then a second, timed run with the same shapes; both produce greedy ids, which
must agree. PyNative runs with synchronous launch (what ``ms-deepseek generate`` does on
CPU). Without the cache, graph mode pads the sequence to its final length (one compiled
shape), PyNative recomputes the exact prefix.

Then: the latent-cache bytes per token of DeepSeek-V2 and V2-Lite against a full
per-head K/V cache, in bfloat16, and what a full context costs in each.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.2f} {unit}"
        n /= 1024
    return str(n)  # pragma: no cover


def bench_mode(mode: str, model, prompt, new_tokens: int):
    import mindspore as ms

    from ms_deepseek.generate import generate

    ms.set_context(mode=ms.GRAPH_MODE if mode == "graph" else ms.PYNATIVE_MODE)
    if mode == "pynative" and ms.get_context("device_target") == "CPU":
        ms.runtime.launch_blocking()
    rows = []
    ids = {}
    for use_cache in (True, False):
        t0 = time.perf_counter()
        generate(model, prompt, new_tokens, eos_ids=(), use_cache=use_cache)  # compile + warm-up
        warm = time.perf_counter() - t0
        res = generate(model, prompt, new_tokens, eos_ids=(), use_cache=use_cache)
        t = res.timings
        tps = t["decode_tokens_per_s"]  # every decode step of the warm run (one forward + sampling each)
        rows.append(
            (mode, "latent cache" if use_cache else "no cache (recompute)", warm, t["prefill_s"], tps, 1000.0 / tps)
        )
        ids[use_cache] = res.ids
    return rows, ids[True] == ids[False]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("graph", "pynative", "both"), default="both")
    parser.add_argument("--preset", default="tiny", help="model preset to time (random weights; default tiny)")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    os.environ.setdefault("GLOG_v", "3")

    import mindspore as ms
    import numpy as np

    from ms_deepseek import DeepseekV2ForCausalLM
    from ms_deepseek.config.model import get_preset
    from ms_deepseek.model.decode import cache_figures

    ms.set_seed(args.seed)
    cfg = get_preset(args.preset)
    model = DeepseekV2ForCausalLM(cfg)
    rng = np.random.default_rng(args.seed)
    prompt = rng.integers(0, cfg.vocab_size, args.prompt_len).tolist()
    modes = ("graph", "pynative") if args.mode == "both" else (args.mode,)

    print(
        f"{args.preset} preset (random weights, {cfg.compute_dtype}), prompt {args.prompt_len} tokens, "
        f"{args.new_tokens} new tokens, batch 1, {ms.get_context('device_target')}, "
        f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}"
    )
    header = f"{'mode':<9} {'path':<22} {'warm-up s':>9} {'prefill s':>9} {'decode tok/s':>12} {'ms/token':>9}"
    print(header)
    print("-" * len(header))
    for mode in modes:
        rows, same = bench_mode(mode, model, prompt, args.new_tokens)
        for m, path, warm, prefill, tps, ms_tok in rows:
            print(f"{m:<9} {path:<22} {warm:>9.2f} {prefill:>9.3f} {tps:>12.1f} {ms_tok:>9.1f}")
        speedup = rows[0][4] / rows[1][4]
        print(
            f"{mode:<9} cache speed-up {speedup:.2f}x; identical greedy ids with and without the cache: "
            f"{'yes' if same else 'NO'}"
        )
    tiny = cache_figures(cfg)
    print(f"\n{args.preset}: {tiny.describe()}")

    print(
        "\nKV cache per token, bfloat16 (latent = kv_lora_rank + qk_rope_head_dim per layer; "
        "full = heads x (qk_head_dim + v_head_dim) per layer):"
    )
    for name in ("deepseek-v2", "deepseek-v2-lite"):
        p = get_preset(name)
        f = cache_figures(p, "bfloat16")
        ctx = p.max_position_embeddings
        print(
            f"  {name:<17} latent {f.latent_bytes_per_token:>9,} B ({_human(f.latent_bytes_per_token)})  "
            f"full {f.full_bytes_per_token:>11,} B ({_human(f.full_bytes_per_token)})  {f.ratio:.1f}x; "
            f"one {ctx:,}-token sequence: {_human(f.latent_bytes_per_token * ctx)} vs "
            f"{_human(f.full_bytes_per_token * ctx)}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
