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

With ``--checkpoint CK --hf-python PY``: ``ms-deepseek generate`` as a user runs it, beside
transformers' ``generate`` on the same weights, whole processes timed from outside:

    python tools/bench_decode.py --checkpoint runs/tiny-cpu --hf-python /tmp/tfvenv/bin/python

The checkpoint is exported once with ``ms-deepseek convert ms-to-hf``; then, per round, side
by side: transformers (``tools/hf_generate.py`` in the reference environment of
tests/fixtures/README.md, with torch's default threads and with one thread), ``ms-deepseek
generate`` cold (an empty ``--compile-cache`` folder: the graphs are compiled) and warm (the
same folder again: the compiled graphs are loaded). Greedy, ``--ignore-eos``. It prints every
round, the medians and the ratios to the faster transformers run, and whether the greedy ids
agree.
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


# ------------------------------------------------------------------ end to end, beside transformers
def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def _timed(cmd, env=None):
    """(wall seconds, stdout) of a whole process; a failure stops the benchmark with its stderr."""
    import subprocess

    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if proc.returncode:
        sys.exit(f"failed ({proc.returncode}): {' '.join(map(str, cmd))}\n{proc.stderr[-3000:]}")
    return wall, proc.stdout


def bench_end_to_end(args) -> int:
    import shutil
    import tempfile

    work = Path(tempfile.mkdtemp(prefix="bench-decode-"))  # the export and the compile caches, removed after
    try:
        return _end_to_end(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _end_to_end(args, work: Path) -> int:
    import json
    import statistics

    ms_cli = [sys.executable, "-m", "ms_deepseek.cli"]
    hf_dir = work / "hf"
    _timed(ms_cli + ["convert", "ms-to-hf", args.checkpoint, str(hf_dir)])
    prompt = args.prompt_ids
    n = str(args.new_tokens)
    hf_script = str(Path(__file__).resolve().parent / "hf_generate.py")
    gen = ms_cli + ["generate", args.checkpoint, "--prompt-ids", prompt, "--max-new-tokens", n, "--ignore-eos"]
    gen += ["--json"]
    runs = {
        "transformers": lambda r: _timed([args.hf_python, hf_script, str(hf_dir), prompt, n]),
        "transformers 1 thread": lambda r: _timed(
            [args.hf_python, hf_script, str(hf_dir), prompt, n, "--threads", "1"]
        ),
        "ms-deepseek cold": lambda r: _timed(gen + ["--compile-cache", str(work / f"compiled-{r}")]),
        "ms-deepseek warm": lambda r: _timed(gen + ["--compile-cache", str(work / f"compiled-{r}")]),
    }
    if args.with_pynative:
        runs["ms-deepseek pynative"] = lambda r: _timed(gen + ["--mode", "pynative"])
    print(
        f"{_cpu_model()}, {os.cpu_count()} cores; {args.checkpoint}; prompt {prompt}; {n} new tokens, greedy, "
        f"--ignore-eos; whole processes; load average at start {os.getloadavg()[0]:.1f}"
    )
    walls = {name: [] for name in runs}
    per_token = {name: [] for name in runs}  # ms per new token inside the process (the generate loop only)
    ids = {}
    for r in range(args.rounds):
        line = []
        for name, run in runs.items():  # side by side: every round runs each once, in this order
            wall, out = run(r)
            walls[name].append(wall)
            result = json.loads(out.strip().splitlines()[-1])
            ids[name] = result["ids"]
            if "generate_s" in result:  # transformers: the whole generate call over its new tokens
                per_token[name].append(1000 * result["generate_s"] / args.new_tokens)
            else:  # ms-deepseek: the decode steps after the first new token
                per_token[name].append(1000 * result["timings"]["decode_s"] / (args.new_tokens - 1))
            line.append(f"{name} {wall:.2f}s")
        print(f"round {r + 1}: " + ", ".join(line) + f" (load {os.getloadavg()[0]:.1f})")
    med = {name: statistics.median(v) for name, v in walls.items()}
    ref = min(med["transformers"], med["transformers 1 thread"])
    print(f"\n{'run':<22} {'median s':>9} {'min s':>7} {'/ transformers':>15} {'ms/token':>9}")
    for name, v in walls.items():
        tok = statistics.median(per_token[name])
        print(f"{name:<22} {med[name]:>9.2f} {min(v):>7.2f} {med[name] / ref:>14.2f}x {tok:>9.2f}")
    same = len({tuple(v) for v in ids.values()}) == 1
    print(f"greedy ids identical across all runs: {'yes' if same else 'NO'}")
    print(
        f"(ratios: median wall time over the faster of the two transformers medians, {ref:.2f}s; ms/token: median "
        f"time per new token inside the process, transformers' whole generate call, ms-deepseek's decode steps)"
    )
    return 0 if same else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("graph", "pynative", "both"), default="both")
    parser.add_argument("--preset", default="tiny", help="model preset to time (random weights; default tiny)")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint", help="end to end: ms-deepseek generate on this checkpoint beside transformers")
    parser.add_argument("--hf-python", help="with --checkpoint: the python of an environment with transformers")
    parser.add_argument("--prompt-ids", default="1,2,3,4,5,6,7,8", help="with --checkpoint (default 1,...,8)")
    parser.add_argument("--rounds", type=int, default=3, help="with --checkpoint: rounds of every run (default 3)")
    parser.add_argument("--with-pynative", action="store_true", help="with --checkpoint: also --mode pynative")
    args = parser.parse_args(argv)
    os.environ.setdefault("GLOG_v", "3")
    if args.checkpoint:
        if not args.hf_python:
            parser.error("--checkpoint needs --hf-python (see tests/fixtures/README.md for the environment)")
        args.new_tokens = args.new_tokens if "--new-tokens" in (argv or sys.argv) else 256
        return bench_end_to_end(args)

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
