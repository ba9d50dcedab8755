"""All checkpoint I/O of ms_deepseek, in one place: files and names, no Cells.

* :mod:`.opener`         the one opener (``open_checkpoint``): HF, ms, training, sharded, LoRA folders;
* :mod:`.weight_files`   the weight files of a whole folder (config, index + shards, tensor locations);
* :mod:`.slice_readers`  slice readers over whole or sharded folders (only the bytes a slice needs);
* :mod:`.safetensors_io` the one safetensors reader and writer (headers, byte ranges, host arrays);
* :mod:`.tensors`        model / optimizer tensors in and out of training checkpoints, RNG state,
                         experts always stored in HF order;
* :mod:`.layout`         which slice of each tensor each rank holds (from the plan) and ``layout.json``;
* :mod:`.opt_shard`      the parallel optimizer's further cut, undone for files and redone on load;
* :mod:`.training`       the run's ``checkpoints/step_N`` folders (whole or ``rank_RRRRR`` slices) and
                         the one "which checkpoint does this path mean" resolver (``resolve_checkpoint``);
* :mod:`.convert`        ``ms-deepseek convert``: HF <-> ms, per-rank loading, merge and resharding, the
                         quantized (QLoRA base) format and ``convert quantize``, random checkpoints.

The atomic folder writer is :mod:`ms_deepseek.core.atomic`; the model's name/shape table is
:mod:`ms_deepseek.config.inventory`.
"""


def __getattr__(name):
    # Lazy: .convert.sharded imports the converter's modules, which importing this package should not.
    if name in ("check_loader_slices", "load_rank", "write_sharded", "merge_to_hf", "write_whole"):
        from ms_deepseek.checkpoint.convert import sharded

        return getattr(sharded, name)
    raise AttributeError(f"module 'ms_deepseek.checkpoint' has no attribute {name!r}")
