"""``ms-deepseek convert {hf-to-ms,ms-to-hf,reshard} SRC DST``.

* ``hf-to-ms SRC DST``: HF folder -> ms_deepseek folder; with ``--recipe RECIPE`` (or
  ``--dp/--tp/--pp/--ep``) a pre-sharded checkpoint instead: ``DST/rank_RRRRR/`` with each
  rank's slices plus ``layout.json``;
* ``ms-to-hf SRC DST``: ms_deepseek folder, training checkpoint (whole or sharded: a
  ``step_N`` folder with ``rank_RRRRR/`` folders, or a run folder: its newest checkpoint)
  -> one HF folder;
* ``reshard SRC DST --recipe RECIPE`` (or the layout flags): a checkpoint of one layout
  (whole or sharded, model and optimizer) into another; a data-parallel target (tp = pp =
  ep = 1, no optimizer sharding) is written whole;
* ``quantize SRC DST --bits {8,4} [--group-size G]``: an HF or ms_deepseek folder -> the same layout
  with weight-only int8 / int4 Linear and routed-expert weights plus scales (a frozen QLoRA base,
  format in docs/lora.md); with ``--recipe RECIPE`` (or the layout flags) pre-sharded like
  ``hf-to-ms --recipe``: each rank's slices of the quantized tensors plus ``layout.json``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ms_deepseek.checkpoint.convert.hf import DEFAULT_SHARD_SIZE, DEFAULT_WORKERS, hf_to_ms, ms_to_hf
from ms_deepseek.checkpoint.layout import is_sharded
from ms_deepseek.cli.args import LAYOUT_FLAGS, add_all, arg, overrides_arg, positive_int, resolve_layout
from ms_deepseek.core.errors import UserError

_HELP = {
    "hf-to-ms": "HuggingFace folder (index + shards, or model.safetensors) -> ms_deepseek layout (routed experts "
    "stacked per layer); with --recipe or --dp/--tp/--pp/--ep: one rank_RRRRR/ folder of slices per rank",
    "ms-to-hf": "ms_deepseek folder or training checkpoint (step_XXXXXXXX/, whole or rank_RRRRR/ slices, or a run "
    "folder) -> HuggingFace layout (per-expert tensors, release config.json); optimizer state is dropped",
    "reshard": "checkpoint of one layout (whole or sharded, model and optimizer) -> another layout (--recipe or "
    "--dp/--tp/--pp/--ep); data-parallel targets are written whole",
    "quantize": "HuggingFace or ms_deepseek folder -> the same layout with int8 / int4 weights and float32 scales "
    "for the Linear layers and routed experts (embeddings, norms, routers, lm_head unchanged): a "
    "frozen base for QLoRA",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Convert checkpoints between the HuggingFace and ms_deepseek layouts, and between "
        "parallel layouts. Streams tensor by tensor (memory stays bounded), keeps the dtype, "
        "writes into a temporary sibling of DST and renames it into place at the end."
    )
    sub = parser.add_subparsers(dest="direction", metavar="{hf-to-ms,ms-to-hf,reshard,quantize}", required=True)
    for name, help_ in _HELP.items():
        p = sub.add_parser(name, help=help_, description=help_ + ".")
        p.add_argument("src", metavar="SRC", help="source checkpoint folder (holds config.json)")
        p.add_argument("dst", metavar="DST", help="destination folder (must not exist or be empty, unless --overwrite)")
        if name == "quantize":
            add_all(p, _QUANTIZE_ARGUMENTS)
        if name != "reshard":
            add_all(p, _WRITER_ARGUMENTS)
        if name != "ms-to-hf":
            g = p.add_argument_group("target layout" + (" (pre-sharded output)" if name != "reshard" else ""))
            add_all(g, _LAYOUT_ARGUMENTS)
        add_all(p, _OUTPUT_ARGUMENTS)


_QUANTIZE_ARGUMENTS = (
    arg(
        "--bits",
        type=int,
        choices=(8, 4),
        required=True,
        help="8: int8, one scale per output channel; 4: int4, two values per byte",
    ),
    arg(
        "--group-size",
        type=positive_int,
        default=None,
        metavar="G",
        help="one scale per G input columns (default: one per output channel); G must divide "
        "every quantized layer's input width",
    ),
)
_WRITER_ARGUMENTS = (
    arg(
        "--workers",
        type=int,
        default=DEFAULT_WORKERS,
        help=f"output shards written in parallel (default {DEFAULT_WORKERS})",
    ),
    arg(
        "--shard-size",
        default=DEFAULT_SHARD_SIZE,
        help=f"maximum bytes per output file, e.g. 500MB, 5GB, 2GiB (default "
        f"{DEFAULT_SHARD_SIZE}); a bigger tensor gets a file of its own",
    ),
)
_LAYOUT_ARGUMENTS = (
    arg("--recipe", help="take the layout from this recipe's parallel: section"),
    overrides_arg("recipe override (with --recipe)"),
) + tuple(
    arg(f"--{flag}", type=positive_int, help=f"parallel.{flag} (overrides the recipe's)")
    for flag in ("dp", "tp", "pp", "ep")
)
_OUTPUT_ARGUMENTS = (
    arg("--overwrite", action="store_true", help="replace a non-empty DST (only once the new folder is complete)"),
    arg("--no-progress", action="store_true", help="no progress bar"),
    arg(
        "--no-fsync",
        action="store_true",
        help="skip flushing output files to disk before the final rename (faster, less safe)",
    ),
)


def layout_from_args(args):
    """The target ParallelConfig from --recipe and/or --dp/--tp/--pp/--ep; None when none is given."""
    from ms_deepseek.config.parallel import ParallelConfig

    flags = [k for k in LAYOUT_FLAGS if getattr(args, k, None) is not None]
    if getattr(args, "recipe", None):
        from ms_deepseek.config.recipe import load_recipe, planning_config_path

        base = load_recipe(args.recipe, args.overrides, planning_config_path(args.recipe)).parallel  # no data needed
    elif flags or getattr(args, "overrides", None):
        if getattr(args, "overrides", None):
            raise UserError("--set: needs --recipe")
        base = ParallelConfig()
    else:
        return None
    return resolve_layout(args, base)


def _resolve_source(src: str) -> Path:
    """A run folder (``RUN/checkpoints/step_N``) stands for its newest complete checkpoint."""
    from ms_deepseek.checkpoint.training import latest_in

    path = Path(src)
    if path.is_dir() and not (path / "config.json").exists():
        found = latest_in(path)
        if found is not None:
            return found
    return path


def run(args: argparse.Namespace) -> int:
    directions = {"reshard": _reshard, "quantize": _quantize, "hf-to-ms": _hf_to_ms, "ms-to-hf": _ms_to_hf}
    result = directions[args.direction](args, not args.no_fsync, not args.no_progress)
    if result is None:  # a sharded output: its line is printed
        return 0
    rate = result.total_bytes / max(result.seconds, 1e-9) / 1e9
    print(
        f"{args.direction}: wrote {result.num_tensors} tensors, {result.total_bytes / 1e9:.3f} GB in "
        f"{len(result.files)} file(s) to {result.dst} in {result.seconds:.1f} s ({rate:.2f} GB/s)"
    )
    return 0


def _reshard(args: argparse.Namespace, fsync: bool, _progress: bool) -> None:
    from ms_deepseek.checkpoint.convert import sharded

    par = layout_from_args(args)
    if par is None:
        raise UserError("reshard: give the target layout with --recipe RECIPE or --dp/--tp/--pp/--ep")
    src = _resolve_source(args.src)
    if par.uses_semi_auto:
        layout = sharded.write_sharded(src, args.dst, par, overwrite=args.overwrite, fsync=fsync)
        print(f"reshard: wrote {layout.world_size} rank folders ({layout.describe()}) to {args.dst}")
    else:
        sharded.write_whole(src, args.dst, overwrite=args.overwrite, fsync=fsync)
        print(f"reshard: wrote a whole checkpoint (data-parallel layouts, any dp) to {args.dst}")


def _quantize(args: argparse.Namespace, fsync: bool, progress: bool):
    from ms_deepseek.checkpoint.convert.quantize import quantize_checkpoint, quantize_sharded

    par = layout_from_args(args)
    if par is not None:
        layout = quantize_sharded(
            args.src, args.dst, args.bits, args.group_size, par, overwrite=args.overwrite, fsync=fsync
        )
        print(
            f"quantize: wrote {layout.world_size} rank folders ({layout.describe()}, "
            f"{len(layout.tensors)} tensors, int{args.bits}) to {args.dst}"
        )
        return None
    return quantize_checkpoint(
        args.src,
        args.dst,
        args.bits,
        args.group_size,
        shard_size=args.shard_size,
        overwrite=args.overwrite,
        progress=progress,
        fsync=fsync,
    )


def _hf_to_ms(args: argparse.Namespace, fsync: bool, progress: bool):
    from ms_deepseek.checkpoint.convert import sharded

    par = layout_from_args(args)
    if par is not None:
        layout = sharded.write_sharded(args.src, args.dst, par, overwrite=args.overwrite, fsync=fsync)
        print(
            f"hf-to-ms: wrote {layout.world_size} rank folders ({layout.describe()}, "
            f"{len(layout.tensors)} tensors) to {args.dst}"
        )
        return None
    return hf_to_ms(args.src, args.dst, **_writer_options(args, fsync, progress))


def _ms_to_hf(args: argparse.Namespace, fsync: bool, progress: bool):
    from ms_deepseek.checkpoint.convert import sharded

    src = _resolve_source(args.src)
    write = sharded.merge_to_hf if is_sharded(src) else ms_to_hf
    return write(src, args.dst, **_writer_options(args, fsync, progress))


def _writer_options(args: argparse.Namespace, fsync: bool, progress: bool) -> dict:
    """The keyword options of a whole-checkpoint writer (hf_to_ms, ms_to_hf, merge_to_hf)."""
    return dict(
        shard_size=args.shard_size, workers=args.workers, overwrite=args.overwrite, progress=progress, fsync=fsync
    )
