"""Quality of a quantized frozen base (QLoRA), measured on CPU; prints the figures of docs/lora.md.

1. Logit error, quantized vs original base (random init at the preset's initializer_range), for
   int8 / int4 per output channel and group-wise: max |dlogit| / max |logit| and mean |dlogit| /
   mean |logit| over a batch, on the ``tiny`` preset and on a V2-Lite-shaped config (the release
   widths: hidden 2048, kv_lora_rank 512, 16 heads, MoE width 1408, dense width 10944; 2 layers,
   8 routed experts, a 4096 vocabulary so it fits a CPU).
2. A LoRA trained on the quantized tiny base (recipes/tiny-qlora-cpu.yaml, shortened): the held-out
   loss of the ORIGINAL float base without and with the exported adapter, beside the same on the
   quantized base, all through ms_deepseek's own ``from_pretrained(base, adapter=...)``.

    PYTHONPATH=. python tools/quant_quality.py [--steps 60] [--skip-lite]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent


def _rel_errors(a: np.ndarray, b: np.ndarray):
    d = np.abs(a - b)
    return float(d.max() / np.abs(b).max()), float(d.mean() / np.abs(b).mean())


def logit_errors(name: str, cfg, schemes, seed: int = 0) -> None:
    import mindspore as ms

    from ms_deepseek.config.quant import QuantSpec
    from ms_deepseek.model.causal_lm import DeepseekV2ForCausalLM
    from ms_deepseek.model.quant import quantize_model

    ms.set_seed(seed)
    ids = ms.Tensor(np.random.default_rng(seed).integers(3, cfg.vocab_size, size=(2, 32)).astype(np.int32))
    model = DeepseekV2ForCausalLM(cfg)
    model.set_train(False)
    ref = model(ids).logits.asnumpy()
    state = {p.name: p.asnumpy().copy() for p in model.get_parameters()}
    for bits, group in schemes:
        t0 = time.perf_counter()
        ms.set_seed(seed)
        q = DeepseekV2ForCausalLM(cfg)
        for p in q.get_parameters():
            p.set_data(ms.Tensor(state[p.name]))
        try:
            quantize_model(q, QuantSpec(bits=bits, group_size=group))
        except Exception as exc:  # a group size that does not divide a width: say which
            print(f"{name:10s} int{bits} group {group or 'channel':>7}: not possible ({exc})")
            continue
        q.set_train(False)
        mx, mean = _rel_errors(q(ids).logits.asnumpy(), ref)
        print(
            f"{name:10s} int{bits} group {str(group or 'channel'):>7}: logits max rel err {mx:.4f}, "
            f"mean rel err {mean:.4f}  ({time.perf_counter() - t0:.1f} s)"
        )


def _val_loss(model, batches) -> float:
    import mindspore as ms

    model.set_train(False)
    losses = [float(model(ms.Tensor(b["input_ids"]), ms.Tensor(b["labels"])).loss.asnumpy()) for b in batches]
    return float(np.mean(losses))


def lora_transfer(steps: int) -> None:
    import mindspore as ms

    from ms_deepseek.cli import main
    from ms_deepseek.config.recipe import load_recipe
    from ms_deepseek.data.prepare import prepare_embedded_default
    from ms_deepseek.model.causal_lm import DeepseekV2ForCausalLM
    from ms_deepseek.train.context import TrainOptions
    from ms_deepseek.train.trainer import build_trainer, start_run

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        prepare_embedded_default(tmp / "data", seq_len=128, vocab_size=4096, max_bytes=400_000, progress=False)
        sets = [
            f"data.path={tmp / 'data'}",
            "data.seq_len=null",
            f"train.steps={steps}",
            "train.micro_batch_size=4",
            "optim.warmup_steps=5",
            "checkpoint.save_interval=0",
            "logging.tensorboard=false",
            "train.mode=pynative",
            "data.validation.fraction=0.1",
            "train.eval_batches=4",
            "model.overrides.num_hidden_layers=2",
            "model.overrides.initializer_range=0.2",
        ]
        recipe = load_recipe(REPO / "recipes" / "tiny-qlora-cpu.yaml", sets)
        trainer = build_trainer(start_run(recipe, tmp / "run", TrainOptions(progress=False)))
        result = trainer.run()
        batches = trainer.data.validation.batches
        print(
            f"tiny-qlora-cpu ({recipe.quant.bits}-bit, group {recipe.quant.group_size}), {steps} steps: "
            f"train loss {np.mean(result.losses[:5]):.3f} -> {np.mean(result.losses[-5:]):.3f}"
        )
        assert main(["export-lora", str(tmp / "run"), str(tmp / "adapter")]) == 0
        base = tmp / "run" / "base"
        assert (
            main(
                [
                    "convert",
                    "quantize",
                    str(base),
                    str(tmp / "q"),
                    "--bits",
                    str(recipe.quant.bits),
                    "--group-size",
                    str(recipe.quant.group_size),
                    "--no-progress",
                ]
            )
            == 0
        )
        ms.set_context(mode=ms.PYNATIVE_MODE)
        rows = {}
        for label, folder in (("original (float) base", base), ("quantized base", tmp / "q")):
            plain = _val_loss(DeepseekV2ForCausalLM.from_pretrained(str(folder), show_progress=False), batches)
            adapted = _val_loss(
                DeepseekV2ForCausalLM.from_pretrained(str(folder), adapter=str(tmp / "adapter"), show_progress=False),
                batches,
            )
            rows[label] = (plain, adapted)
            print(
                f"  {label:22s}: held-out loss {plain:.4f} -> {adapted:.4f} with the adapter (-{plain - adapted:.4f})"
            )
        (p0, a0), (p1, a1) = rows.values()
        print(
            f"  the adapter's gain on the original base is {100 * (p0 - a0) / (p1 - a1):.1f}% of its gain on the "
            "quantized base it was trained on"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--skip-lite", action="store_true")
    args = parser.parse_args()
    import mindspore as ms

    from ms_deepseek.config.model import get_preset

    ms.set_context(mode=ms.PYNATIVE_MODE)
    schemes = [(8, None), (4, None), (4, 128), (4, 64), (4, 32)]
    logit_errors("tiny", get_preset("tiny", capacity_factor=None), schemes)
    if not args.skip_lite:
        lite = get_preset(
            "deepseek-v2-lite",
            num_hidden_layers=2,
            n_routed_experts=8,
            vocab_size=4096,
            capacity_factor=None,
            rope_scaling=None,
            max_position_embeddings=4096,
        )
        logit_errors("v2-lite-2L", lite, schemes)
    lora_transfer(args.steps)


if __name__ == "__main__":
    main()
