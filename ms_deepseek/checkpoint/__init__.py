"""All checkpoint I/O of ms_deepseek, in one place.

* :mod:`.atomic`    the one atomic writer: a temporary sibling folder, every file and the folder
                    fsynced, swapped in with no moment when no complete checkpoint exists;
* :mod:`.tensors`   whole safetensors files in and out of a model or optimizer, raw slice reads,
                    RNG state, experts always stored in HF order;
* :mod:`.layout`    which slice of each tensor each rank holds (from the plan) and ``layout.json``;
* :mod:`.training`  the run's ``checkpoints/step_N`` folders (whole or ``rank_RRRRR`` slices);
* :mod:`.sharded`   per-rank loading straight from HF / ms_deepseek safetensors, pre-sharded
                    conversion, merge back to HF, resharding.

The model's name/shape table is :mod:`ms_deepseek.spec.inventory`.
"""


def __getattr__(name):
    # Lazy: the converter imports .atomic, and .sharded imports the converter's modules.
    if name in ("check_loader_slices", "load_rank", "write_sharded", "merge_to_hf", "write_whole"):
        from ms_deepseek.checkpoint import sharded

        return getattr(sharded, name)
    raise AttributeError(f"module 'ms_deepseek.checkpoint' has no attribute {name!r}")
