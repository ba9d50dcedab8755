"""The single-device side of ``plan --execute``: the reduced recipe trained on one CPU device by the product.

Run by :mod:`ms_deepseek.verification.execute.check` as ``python -m ms_deepseek.verification.execute.one_device
REQUEST.json`` in a plain CPU process. It builds the trainer's own one-device run of the recipe from the
trainer's parts (:mod:`ms_deepseek.train.build`: the model read from the weights folder, the model converter,
the plan, our AdamW and the compiled step in graph mode) and feeds it the global batches the ranks read
(``batches.npz``: per step ``[k * global rows, T]`` input ids and labels, micro-batch-major). Before the first step
and after every step it writes every parameter of the step (model, optimizer state, counters) to
``values_<step>.safetensors``, and the step's outputs (the loss vector, gradient norm, learning rate) to
``result.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np


def run(request_path: str) -> int:
    from mindspore import Tensor
    from safetensors.numpy import save_file

    from ms_deepseek.config.recipe import recipe_from_request
    from ms_deepseek.core.runtime import use_device
    from ms_deepseek.train.build import build_model, build_step, check_layout
    from ms_deepseek.train.context import ModelSource, RunContext
    from ms_deepseek.train.lora_run import model_converter
    from ms_deepseek.train.parallelism import DATA_PARALLEL

    request = json.loads(Path(request_path).read_text())
    out = Path(request_path).parent
    recipe = recipe_from_request(request["recipe"])
    plan = check_layout(recipe, DATA_PARALLEL, force=True)
    use_device()
    ctx = RunContext(recipe, out / "run")
    converter = model_converter(recipe)
    base = converter.weights_folder(recipe, ctx.run_dir)
    built = build_model(ctx, DATA_PARALLEL, converter, ModelSource(base, load=True, write_base=base is None), plan)
    # the device-level and communication balance losses are defined over the layout's expert-parallel device groups
    # (model/router.py set_expert_parallel): one device computes them over the groups of the layout it is compared with
    for _, cell in built[0].cells_and_names():
        if callable(getattr(getattr(cell, "gate", None), "set_expert_parallel", None)):
            cell.gate.set_expert_parallel(int(request.get("expert_parallel", 1)))
    rows = recipe.train.micro_batch_size
    tensors, _ = build_step(ctx, DATA_PARALLEL, converter, built, (rows, recipe.data.seq_len or 0))
    DATA_PARALLEL.materialize(ctx, tensors, converter, fresh=True)
    batches = np.load(out / "batches.npz")

    def dump(step: int) -> None:
        values = {p.name: np.ascontiguousarray(p.asnumpy()) for p in tensors.step_cell.get_parameters()}
        save_file(values, str(out / f"values_{step}.safetensors"))

    dump(0)
    steps = []
    for step in range(1, int(request["steps"]) + 1):
        converter.before_step(tensors.model, recipe.train.seed, step, 0)
        ids, labels = batches[f"ids_{step}"], batches[f"labels_{step}"]
        outputs, grad_norm, lr, _, _ = tensors.step_cell(Tensor(ids), Tensor(labels))
        steps.append(
            {
                "outputs": outputs.asnumpy().astype(float).tolist(),
                "grad_norm": float(grad_norm.asnumpy()),
                "lr": float(lr.asnumpy()),
            }
        )
        dump(step)
    (out / "result.json").write_text(json.dumps({"steps": steps}))
    return 0


if __name__ == "__main__":
    sys.exit(run(sys.argv[1]))
