#!/usr/bin/env python
"""Training-step benchmark against the CPU anchors of docs/measurements.md ("Training step on CPU").

    python tools/bench_step.py                                    # the full table: every row, with its breakdown
    python tools/bench_step.py --quick                            # fewer steps, no breakdown
    python tools/bench_step.py --torch-python /work/.venv-ref/bin/python   # + transformers, same run

The benchmark config (43.6M parameters, 18.7M activated per token): hidden 512, 4 layers
(layer 0 dense, layers 1-3 MoE), 16 routed experts top-2 (greedy) + 2 shared experts,
moe_intermediate_size 256, MLA with 8 heads (qk_nope 64, qk_rope 32, v 64),
kv_lora_rank 256, q_lora_rank 256, vocab 16384, no YaRN; batch 2 x 512 tokens, float32.
The dense layer's intermediate size is (k + n_shared) * 256 = 1024, so the dense baseline
(every layer that dense MLP: same attention, equal activated FLOPs) is the same config
with ``first_k_dense_replace = num_hidden_layers``.

Each row runs in its own subprocess (a fresh MindSpore or torch, its own compile cache):

* ``moe cf=2.0`` / ``moe cf=1.0``: the trainer's compiled step (``ms_deepseek.train.step.
  build_step``: forward + backward + clip + AdamW (fused kernel), one graph) in GRAPH_MODE,
  with the capacity factor given; the dropped fraction of routed slots is printed.
* ``moe dropless``: the same step with ``moe_dispatch: dropless`` (every routed choice, sorted by expert,
  through the grouped matmul; nothing dropped).
* ``dense``: the same step on the dense baseline.
* ``moe cf=2.0 pynative`` (async launch, as the trainer runs it) and ``... pynative+blocking``
  (``ms.runtime.launch_blocking()``): the same step Cell in PyNative, fewer steps.
* with ``--torch-python``: transformers' ``DeepseekV2ForCausalLM`` (dropless; eager
  attention + eager expert loop, and sdpa + grouped_mm experts), torch AdamW, clip 1.0.

Timing: ``--warmup`` steps (the first one compiles) are excluded; each timed step ends
with a host read of the loss (``ms.runtime.synchronize()`` does nothing on CPU); the table
shows the median. Unless ``--quick``, the cf=2.0 run also times its parts: the forward
alone, forward + backward (gradients only), and the optimizer update alone, each its own
compiled graph, to show where a step's time goes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARK = "BENCH_RESULT "
BATCH, SEQ = 2, 512

# The benchmark config (HF field names); everything not listed takes DeepseekV2Config's default.
BENCH_CONFIG = dict(
    vocab_size=16384,
    hidden_size=512,
    intermediate_size=1024,
    moe_intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=8,
    n_shared_experts=2,
    n_routed_experts=16,
    routed_scaling_factor=1.0,
    kv_lora_rank=256,
    q_lora_rank=256,
    qk_rope_head_dim=32,
    qk_nope_head_dim=64,
    v_head_dim=64,
    topk_method="greedy",
    n_group=1,
    topk_group=1,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    norm_topk_prob=False,
    aux_loss_alpha=0.001,
    seq_aux=True,
    max_position_embeddings=2048,
    rope_scaling=None,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    initializer_range=0.02,
)


# ----------------------------------------------------------------------------- shared helpers
def _batch(vocab: int, seed: int = 0):
    import numpy as np

    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, (BATCH, SEQ)).astype(np.int32)  # [B, T]
    return ids, ids.copy()  # labels = inputs (the model shifts them)


def _time_steps(run_one, warmup: int, steps: int):
    """run_one() must end in a host read. Returns (per-step seconds of the timed steps, compile+warm-up s)."""
    t0 = time.perf_counter()
    for _ in range(warmup):
        run_one()
    warm = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        run_one()
        times.append(time.perf_counter() - t0)
    return times, warm


def _emit(result: dict) -> None:
    print(MARK + json.dumps(result), flush=True)


# ----------------------------------------------------------------------------- MindSpore worker
def _ms_worker(case: str, args) -> None:
    os.environ.setdefault("GLOG_v", "3")
    import mindspore as ms
    import numpy as np
    from mindspore import Tensor

    from ms_deepseek.config.inventory import count_parameters
    from ms_deepseek.config.model import DeepseekV2Config
    from ms_deepseek.config.parallel import ParallelConfig
    from ms_deepseek.config.recipe import OptimSection, TrainSection
    from ms_deepseek.train import optim

    ms.set_device("CPU")
    if args.threads:
        ms.device_context.cpu.op_tuning.threads_num(args.threads)
    values = dict(BENCH_CONFIG)
    if case == "dense":
        values["first_k_dense_replace"] = values["num_hidden_layers"]  # every layer the (k + shared) * I MLP
    elif case == "moe_dropless":
        values["moe_dispatch"] = "dropless"  # every routed choice through the grouped matmul
    else:
        values["capacity_factor"] = 1.0 if case == "moe_cf1" else 2.0
    cfg = DeepseekV2Config(**values)
    count = count_parameters(cfg)
    pynative = case.startswith("moe_pynative")

    ms.set_seed(0)
    np.random.seed(0)
    from ms_deepseek.model.causal_lm import DeepseekV2ForCausalLM
    from ms_deepseek.train.step import build_step

    model = DeepseekV2ForCausalLM(cfg)
    model.set_train(True)
    params = model.trainable_params()
    optimizer = optim.build_optimizer(params, OptimSection(lr=3e-4, schedule="constant"), 1000)
    ms.set_context(mode=ms.PYNATIVE_MODE if pynative else ms.GRAPH_MODE)
    if case == "moe_pynative_blocking":
        ms.runtime.launch_blocking()
    moe_layers = cfg.moe_layer_indices
    E = cfg.n_routed_experts if moe_layers else 0
    step_cell, update = build_step(model, optimizer, TrainSection(clip_grad_norm=1.0), ParallelConfig())
    ids, labels = _batch(cfg.vocab_size)
    ids_t, labels_t = Tensor(ids), Tensor(labels)
    last = {}

    def one_step():
        outputs, grad_norm, _, _, _ = step_cell(ids_t, labels_t)
        last["vec"] = outputs.asnumpy()  # host read: the step is finished
        last.setdefault("first", last["vec"])  # step 1: routing at random init
        last["grad_norm"] = float(grad_norm.asnumpy())

    steps = max(2, args.steps // 3) if pynative else args.steps
    warmup = max(1, args.warmup // 2) if pynative else args.warmup
    times, warm = _time_steps(one_step, warmup, steps)
    vec = last["vec"]
    result = {
        "case": case,
        "times": times,
        "warm_s": warm,
        "loss": float(vec[1]),
        "grad_norm": last["grad_norm"],
        "params": count.total,
        "activated": count.activated,
        "tokens": BATCH * SEQ,
    }
    if moe_layers:
        stats = vec[3:].reshape(len(moe_layers), E + 4)  # [L_moe, E + 4]: load..., dropped, l_exp, l_dev, l_com
        result["dropped"] = {str(i): float(stats[j, E]) for j, i in enumerate(moe_layers)}
        first = last["first"][3:].reshape(len(moe_layers), E + 4)
        result["dropped_init"] = {str(i): float(first[j, E]) for j, i in enumerate(moe_layers)}
        moe = model.model.layers[moe_layers[0]].mlp
        result["capacity"] = "dropless" if moe.dropless else moe.capacity(BATCH * SEQ)
    if case == "moe_cf2" and args.breakdown:
        result["parts"] = _breakdown(model, step_cell, update, ids_t, labels_t, args)
    _emit(result)


def _breakdown(model, step_cell, update, ids_t, labels_t, args) -> dict:
    """Median seconds of the step's parts, each compiled as its own graph."""
    from mindspore import nn, ops

    net = step_cell.net  # StepOutputs: the model + the loss vector

    class GradOnly(nn.Cell):
        """Forward + backward, no optimizer, no separate forward output."""

        def __init__(self):
            super().__init__(auto_prefix=False)
            self.net = net
            self.weights = step_cell.weights
            self.grad = ops.GradOperation(get_by_list=True, sens_param=True)
            self.sens = step_cell.onehot

        def construct(self, input_ids, labels):
            return self.grad(self.net, self.weights)(input_ids, labels, self.sens)

    grad_only = GradOnly()
    parts = {}
    n = max(2, args.steps // 2)
    holder = {}

    def fwd():
        holder["v"] = net(ids_t, labels_t).asnumpy()

    def fwd_bwd():
        grads = grad_only(ids_t, labels_t)
        holder["g"] = grads
        grads[0].asnumpy()

    parts["forward"] = statistics.median(_time_steps(fwd, 1, n)[0])
    parts["forward+backward"] = statistics.median(_time_steps(fwd_bwd, 1, n)[0])
    grads = holder["g"]

    def upd():
        grad_norm, _, _, _ = update(grads)
        grad_norm.asnumpy()

    parts["update (clip + AdamW)"] = statistics.median(_time_steps(upd, 1, n)[0])
    return parts


# ----------------------------------------------------------------------------- torch worker
def _torch_worker(case: str, args) -> None:
    """Runs under the reference venv (torch + transformers); imports nothing from ms_deepseek."""
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    values = json.loads(Path(args.hf_config).read_text())
    hf_cfg = DeepseekV2Config(**values)
    attn, experts = ("eager", "eager") if case == "hf_eager" else ("sdpa", "grouped_mm")
    try:
        model = DeepseekV2ForCausalLM._from_config(
            hf_cfg, attn_implementation=attn, experts_implementation=experts, torch_dtype=torch.float32
        )
    except (ValueError, ImportError) as exc:  # an implementation this build lacks
        _emit({"case": case, "error": f"{attn}/{experts}: {exc}".splitlines()[0]})
        return
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    ids, labels = _batch(values["vocab_size"])
    ids_t, labels_t = torch.from_numpy(ids).long(), torch.from_numpy(labels).long()
    last = {}

    def one_step():
        loss = model(input_ids=ids_t, labels=labels_t).loss
        loss.backward()
        last["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        opt.step()
        opt.zero_grad(set_to_none=True)
        last["loss"] = loss.item()  # host read

    times, warm = _time_steps(one_step, args.warmup, args.steps)
    impl = f"{model.config._attn_implementation}/{model.config._experts_implementation}"
    _emit(
        {
            "case": case,
            "times": times,
            "warm_s": warm,
            "loss": last["loss"],
            "grad_norm": last["grad_norm"],
            "params": sum(p.numel() for p in model.parameters()),
            "tokens": BATCH * SEQ,
            "impl": impl,
        }
    )


# ----------------------------------------------------------------------------- driver
LABELS = {
    "moe_cf2": "moe cf=2.0 graph",
    "moe_cf1": "moe cf=1.0 graph",
    "moe_dropless": "moe dropless (grouped matmul) graph",
    "dense": "dense (equal activated FLOPs) graph",
    "moe_pynative": "moe cf=2.0 pynative (async launch)",
    "moe_pynative_blocking": "moe cf=2.0 pynative+launch_blocking",
    "hf_eager": "transformers eager",
    "hf_sdpa": "transformers sdpa+grouped_mm",
}


def _run_case(case: str, python: str, args, hf_config: str, workdir: Path) -> dict:
    cmd = [
        python,
        str(Path(__file__).resolve()),
        "--worker",
        case,
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--threads",
        str(args.threads),
        "--hf-config",
        hf_config,
    ]
    if args.breakdown:
        cmd.append("--breakdown")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), GLOG_v="3")
    case_dir = Path(tempfile.mkdtemp(prefix=case + "-", dir=workdir))  # MindSpore writes compile droppings into the cwd
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=case_dir, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    for line in proc.stdout.splitlines():
        if line.startswith(MARK):
            result = json.loads(line[len(MARK) :])
            result["wall_s"] = wall
            # 1-minute load average before / after: other processes on the host skew the timing
            result["load"] = (load_before, os.getloadavg()[0])
            return result
    tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
    return {"case": case, "error": f"exit {proc.returncode}: {tail}"}


def _merge(previous, result):
    """One row from its rounds: every round's step times, the first round's other fields, the load range."""
    if previous is None or "times" not in previous:
        return result
    if "times" not in result:
        return previous
    merged = dict(previous)
    merged["times"] = previous["times"] + result["times"]
    merged["load"] = (min(previous["load"][0], result["load"][0]), max(previous["load"][1], result["load"][1]))
    return merged


def _table(results, tokens: int) -> str:
    ok = {r["case"]: r for r in results if "times" in r}
    med = {c: statistics.median(r["times"]) for c, r in ok.items()}
    hf_ref = [c for c in ("hf_sdpa", "hf_eager") if c in med]
    head = f"{'run':40s} {'s/step':>8s} {'min':>7s} {'tok/s':>8s} {'/dense':>7s}"
    head += "".join(f" {'/' + c[3:]:>7s}" for c in hf_ref) + f" {'steps':>5s} {'warm s':>7s}  notes"
    lines = [head, "-" * len(head)]
    for r in results:
        c = r["case"]
        if c not in ok:
            lines.append(f"{LABELS[c]:40s} FAILED: {r.get('error', '?')}")
            continue
        s = med[c]
        row = f"{LABELS[c]:40s} {s:8.3f} {min(r['times']):7.3f} {tokens / s:8.0f} "
        row += f"{s / med['dense']:7.2f}" if "dense" in med else f"{'-':>7s}"
        row += "".join(f" {s / med[h]:7.2f}" for h in hf_ref)
        notes = [f"loss {r['loss']:.4f}"]
        if "dropped" in r:
            d = list(r["dropped"].values())
            d0 = list(r["dropped_init"].values())
            notes.append(f"C={r['capacity']} dropped mean step 1 {sum(d0) / len(d0):.1%}, last {sum(d) / len(d):.1%}")
        if "impl" in r:
            notes.append(r["impl"])
        notes.append("load %.1f->%.1f" % tuple(r["load"]))
        row += f" {len(r['times']):5d} {r['warm_s']:7.1f}  " + ", ".join(notes)
        lines.append(row)
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="Time the ms_deepseek training step (forward + backward + AdamW) on the 43.6M-parameter "
        "benchmark config (hidden 512, 4 layers, 16 experts top-2 + 2 shared, 2 x 512 tokens, fp32) "
        "against a dense baseline of equal activated FLOPs, PyNative, and optionally transformers.",
        epilog="Rows: moe cf=2.0 / cf=1.0 graph, moe dropless graph, dense graph, moe pynative (async and blocking launch), "
        "transformers eager and sdpa+grouped_mm (--torch-python). Ratios are s/step over the dense row "
        "and over each transformers row. Each row runs in its own subprocess.",
    )
    p.add_argument(
        "--steps",
        type=int,
        default=8,
        help="timed steps per graph-mode row; PyNative rows time steps//3 (at least 2) (default 8)",
    )
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first, the first compiles (default 2)")
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="CPU threads for MindSpore kernels and torch (0 = each framework's default)",
    )
    p.add_argument("--quick", action="store_true", help="3 timed steps, 1 warm-up, no per-part breakdown")
    p.add_argument(
        "--torch-python",
        metavar="PYTHON",
        help="a Python with torch + transformers >= 5.15 "
        "(e.g. /work/.venv-ref/bin/python): adds transformers rows measured in this run",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the rows this many times in turn (row A, B, ..., A, B, ...) and pool each row's step times: "
        "on a host shared with other processes every row then sees the same spread of load (default 1)",
    )
    p.add_argument("--only", metavar="CASES", help="comma-separated subset of: " + ",".join(LABELS))
    p.add_argument("--json", metavar="PATH", help="also write the raw results (every step time) here")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--hf-config", help=argparse.SUPPRESS)
    p.add_argument("--breakdown", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    if args.steps < 1 or args.warmup < 1:
        p.error("--steps and --warmup must be >= 1 (the first warm-up step compiles)")
    if args.quick and not args.worker:
        args.steps, args.warmup = 3, 1
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        (_torch_worker if args.worker.startswith("hf_") else _ms_worker)(args.worker, args)
        return 0
    args.breakdown = not args.quick
    cases = ["moe_cf2", "moe_cf1", "moe_dropless", "dense", "moe_pynative", "moe_pynative_blocking"]
    if args.torch_python:
        cases += ["hf_eager", "hf_sdpa"]
    if args.only:
        wanted = [c.strip() for c in args.only.split(",") if c.strip()]
        unknown = [c for c in wanted if c not in LABELS]
        if unknown:
            print(f"--only: unknown case(s) {', '.join(unknown)}; choose from {', '.join(LABELS)}", file=sys.stderr)
            return 2
        if any(c.startswith("hf_") for c in wanted) and not args.torch_python:
            print("--only: transformers rows need --torch-python", file=sys.stderr)
            return 2
        cases = [c for c in cases if c in wanted] + [c for c in wanted if c not in cases]

    sys.path.insert(0, str(ROOT))
    from ms_deepseek.config.inventory import count_parameters
    from ms_deepseek.config.model import DeepseekV2Config  # no mindspore import

    cfg = DeepseekV2Config(**BENCH_CONFIG)
    count = count_parameters(cfg)
    print(
        f"config: {count.total / 1e6:.2f}M parameters ({count.activated / 1e6:.2f}M activated per token), "
        f"hidden 512, 4 layers (MoE {cfg.moe_layer_indices}), 16 experts top-2 + 2 shared (I=256), "
        f"MLA 8 heads kv_lora 256 q_lora 256, vocab 16384; batch {BATCH} x {SEQ} tokens, float32; "
        f"{args.steps} timed steps (median), {args.warmup} warm-up; threads "
        f"{args.threads or 'default'}",
        flush=True,
    )
    results = []
    with tempfile.TemporaryDirectory(prefix="bench_step_") as tmp:
        workdir = Path(tmp)
        hf_config = workdir / "hf_config.json"
        hf = cfg.to_hf_dict("float32")
        hf.pop("architectures", None)
        hf.pop("model_type", None)
        hf.pop("torch_dtype", None)
        hf_config.write_text(json.dumps(hf))
        from tqdm import tqdm

        by_case = {}
        bar = tqdm([c for _ in range(args.rounds) for c in cases], desc="bench", unit="run", leave=False)
        for case in bar:
            bar.set_postfix_str(case)
            python = args.torch_python if case.startswith("hf_") else sys.executable
            result = _run_case(case, python, args, str(hf_config), workdir)
            by_case[case] = _merge(by_case.get(case), result)
            if "times" in result:
                bar.write(
                    f"  {LABELS[case]}: median {statistics.median(result['times']):.3f} s/step "
                    f"(process {result['wall_s']:.0f} s)"
                )
            else:
                bar.write(f"  {LABELS[case]}: FAILED {result['error']}")
        bar.close()
    results = [by_case[c] for c in cases]
    print()
    print(_table(results, BATCH * SEQ))
    print(
        f"(host: {os.cpu_count()} CPUs; 'load' is the 1-minute load average before -> after each row: "
        f"above ~{os.cpu_count()} means other processes shared the cores)"
    )
    for r in results:
        if "parts" in r:
            full = statistics.median(r["times"])
            print(f"\nwhere a '{LABELS[r['case']]}' step goes (each part its own compiled graph, median):")
            for name, s in r["parts"].items():
                print(f"  {name:28s} {s:7.3f} s  ({s / full:5.1%} of the full step {full:.3f} s)")
            rest = full - r["parts"]["forward+backward"] - r["parts"]["update (clip + AdamW)"]
            print(f"  {'full - (fwd+bwd) - update':28s} {rest:7.3f} s  (the step's extra forward output and glue)")
        if "dropped" in r:
            print(
                f"dropped fraction ({LABELS[r['case']]}), per MoE layer, step 1 (random init) -> last step "
                "(the same batch every step, so routing drifts as the model fits it): "
                + ", ".join(f"layer {k}: {r['dropped_init'][k]:.1%} -> {v:.1%}" for k, v in r["dropped"].items())
            )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    return 0 if all("times" in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
