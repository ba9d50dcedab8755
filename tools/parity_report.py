#!/usr/bin/env python
"""Print how closely the MindSpore port matches the transformers reference, per checkpoint and mode.

    python tools/parity_report.py                       # the committed fixtures
    python tools/parity_report.py /tmp/ckpt_a /tmp/ckpt_b   # folders made by make_reference.py --config

Each folder must hold a checkpoint plus reference.safetensors / reference.json as written by
tests/fixtures/make_reference.py. Prints max |logits error|, |loss error|, routing-set
agreement, max gradient error relative to the gradient's max, and aux-loss error, in PyNative
and graph mode. Exit status 1 if any figure is outside the test tolerances.
"""

import argparse
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "fixtures"))

TOL = {"logits": 1e-4, "loss": 1e-5, "grad": 1e-3, "aux": 1e-4}


def measure(folder: Path, mode: str) -> dict:
    import mindspore as ms
    from load_reference import load_reference, routing
    from mindspore import Tensor
    from parity import gradient_errors

    from ms_deepseek import DeepseekV2ForCausalLM

    ms.set_context(mode=ms.GRAPH_MODE if mode == "graph" else ms.PYNATIVE_MODE)
    ref = load_reference(folder)
    model = DeepseekV2ForCausalLM.from_pretrained(folder, show_progress=False)
    model.output_routing = True
    ids, labels = Tensor(ref["input_ids"].astype(np.int32)), Tensor(ref["labels"].astype(np.int32))
    out = model(ids, labels)
    cfg = model.config
    same_sets = True
    for slot, layer in enumerate(cfg.moe_layer_indices):
        got = np.sort(out.routing[slot][1].asnumpy(), 1)
        same_sets &= bool((got == np.sort(routing(ref, layer)[1], 1)).all())
    aux_ref = sum(ref["summary"]["aux"][str(i)]["seq"] for i in cfg.moe_layer_indices)
    return {
        "logits": float(np.abs(out.logits.asnumpy() - ref["logits"]).max()),
        "loss": abs(float(out.loss.asnumpy()) - float(ref["loss"])),
        "grad": max(gradient_errors(model, ref, mode).values()),
        "aux": abs(float(out.aux_loss.asnumpy()) - aux_ref) / max(abs(aux_ref), 1e-12),
        "routing": same_sets,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="*", type=Path, help="reference folders (default: committed fixtures)")
    args = parser.parse_args()
    from load_reference import FIXTURES_DIR, VARIANTS

    folders = args.folders or [FIXTURES_DIR / v for v in VARIANTS]
    print(f"{'checkpoint':<14}{'mode':<10}{'logits':>10}{'loss':>10}{'grad/max':>10}{'aux rel':>10}  routing")
    ok = True
    for folder in folders:
        for mode in ("pynative", "graph"):
            m = measure(folder, mode)
            good = m["routing"] and all(m[k] <= TOL[k] for k in TOL)
            ok &= good
            print(
                f"{folder.name:<14}{mode:<10}{m['logits']:>10.2e}{m['loss']:>10.2e}{m['grad']:>10.2e}"
                f"{m['aux']:>10.2e}  {'same sets' if m['routing'] else 'DIFFERENT'}{'' if good else '  FAIL'}"
            )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
