#!/usr/bin/env python
"""A decode step's MoE on the benchmark config of tools/bench_step.py: the one-token path against the dropless path.

    python tools/bench_moe_decode.py                   # graph and PyNative, 1 and 4 rows
    python tools/bench_moe_decode.py --mode graph --rows 1 --rounds 9

One dropless MoE layer (16 experts top-2 + 2 shared, hidden 512, I=256) in evaluation, x [B, 1, H]: the gathered
weights of the chosen experts (``DeepseekV2MoE.one_token``) and the dropless path (``construct_dropless``: the B*k
rows through the grouped kernel). Each path's output is compared with the other's first (the largest difference is
printed beside the largest value); then rounds of
``--calls`` calls per path, interleaved, and the median and minimum milliseconds per call. PyNative runs with
synchronous launch, as ``ms-deepseek generate`` does on CPU. ``ms_deepseek.generate`` picks between the two per mode
(``DeepseekV2MoE.set_decode_mode``) from these figures (docs/measurements.md, "Training step on CPU").
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def row_counts(text: str):
    """``--rows``: comma-separated positive integers."""
    try:
        rows = [int(r) for r in text.split(",")]
    except ValueError:
        rows = []
    if not rows or min(rows) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return rows


def positive(text: str) -> int:
    """``--rounds`` / ``--calls``: a positive integer."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mode", choices=["graph", "pynative", "both"], default="both")
    p.add_argument("--rows", type=row_counts, default="1,4", help="comma-separated batch rows B of the one-token step")
    p.add_argument("--rounds", type=positive, default=5, help="interleaved rounds per path")
    p.add_argument("--calls", type=positive, default=20, help="calls timed together per round")
    return p.parse_args(argv)


def run_mode(mode: str, rows, rounds: int, calls: int) -> None:
    import mindspore as ms
    import numpy as np
    from bench_step import BENCH_CONFIG
    from mindspore import Tensor, nn

    from ms_deepseek.config.model import DeepseekV2Config
    from ms_deepseek.model.moe import DeepseekV2MoE

    ms.set_context(mode=ms.GRAPH_MODE if mode == "graph" else ms.PYNATIVE_MODE)
    if mode == "pynative":
        ms.runtime.launch_blocking()
    ms.set_seed(0)
    moe = DeepseekV2MoE(DeepseekV2Config(**{**BENCH_CONFIG, "moe_dispatch": "dropless"}))
    moe.set_train(False)

    class OneToken(nn.Cell):
        def __init__(self):
            super().__init__()
            self.moe = moe

        def construct(self, x):
            return self.moe.one_token(x)

    class Dropless(nn.Cell):
        def __init__(self):
            super().__init__()
            self.moe = moe

        def construct(self, x):
            return self.moe.construct_dropless(x)[0]

    paths = {"one_token": OneToken(), "dropless": Dropless()}
    H = BENCH_CONFIG["hidden_size"]
    for B in rows:
        x = Tensor(np.random.default_rng(B).standard_normal((B, 1, H)).astype(np.float32))
        outs = {name: cell(x).asnumpy() for name, cell in paths.items()}  # compiles in graph mode
        scale = float(np.abs(outs["one_token"]).max())
        gap = float(np.abs(outs["dropless"] - outs["one_token"]).max())
        times = {name: [] for name in paths}
        for _ in range(rounds):
            for name, cell in paths.items():
                t0 = time.perf_counter()
                for _ in range(calls):
                    cell(x).asnumpy()
                times[name].append((time.perf_counter() - t0) / calls)
        for name in paths:
            med, low = statistics.median(times[name]) * 1e3, min(times[name]) * 1e3
            print(f"{mode:8s} B={B:<3d} {name:10s} median {med:7.3f} ms  min {low:7.3f} ms", flush=True)
        print(f"{mode:8s} B={B:<3d} largest difference {gap:.2e} (largest value {scale:.2e})", flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("GLOG_v", "3")
    import mindspore as ms

    ms.set_device("CPU")
    modes = ["graph", "pynative"] if args.mode == "both" else [args.mode]
    for mode in modes:
        run_mode(mode, args.rows, args.rounds, args.calls)
    return 0


if __name__ == "__main__":
    sys.exit(main())
