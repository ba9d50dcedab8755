"""``ms-deepseek convert hf-to-ms SRC DST`` / ``ms-deepseek convert ms-to-hf SRC DST``."""

from __future__ import annotations

import argparse

from ms_deepseek.convert.api import DEFAULT_SHARD_SIZE, DEFAULT_WORKERS, hf_to_ms, ms_to_hf

_DIRECTIONS = {
    "hf-to-ms": (hf_to_ms, "HuggingFace folder (index + shards, or model.safetensors) -> ms_deepseek layout "
                           "(routed experts stacked per layer)"),
    "ms-to-hf": (ms_to_hf, "ms_deepseek folder or training checkpoint (step_XXXXXXXX/) -> HuggingFace layout "
                           "(per-expert tensors, release config.json); optimizer state is dropped"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = ("Convert checkpoints between the HuggingFace and ms_deepseek layouts. Streams byte "
                          "ranges (memory stays flat), keeps the dtype, writes into a temporary sibling of DST "
                          "and renames it into place at the end.")
    sub = parser.add_subparsers(dest="direction", metavar="{hf-to-ms,ms-to-hf}", required=True)
    for name, (_, help_) in _DIRECTIONS.items():
        p = sub.add_parser(name, help=help_, description=help_ + ".")
        p.add_argument("src", metavar="SRC", help="source checkpoint folder (holds config.json)")
        p.add_argument("dst", metavar="DST", help="destination folder (must not exist or be empty, "
                                                  "unless --overwrite)")
        p.add_argument("--workers", type=int, default=DEFAULT_WORKERS,
                       help=f"output shards written in parallel (default {DEFAULT_WORKERS})")
        p.add_argument("--shard-size", default=DEFAULT_SHARD_SIZE,
                       help=f"maximum bytes per output file, e.g. 500MB, 5GB, 2GiB (default {DEFAULT_SHARD_SIZE}); "
                            "a bigger tensor gets a file of its own")
        p.add_argument("--overwrite", action="store_true", help="replace a non-empty DST (only once the new "
                                                                "folder is complete)")
        p.add_argument("--no-progress", action="store_true", help="no progress bar")
        p.add_argument("--no-fsync", action="store_true",
                       help="skip flushing output files to disk before the final rename (faster, less safe)")


def run(args: argparse.Namespace) -> int:
    fn, _ = _DIRECTIONS[args.direction]
    result = fn(args.src, args.dst, shard_size=args.shard_size, workers=args.workers, overwrite=args.overwrite,
                progress=not args.no_progress, fsync=not args.no_fsync)
    rate = result.total_bytes / max(result.seconds, 1e-9) / 1e9
    print(f"{args.direction}: wrote {result.num_tensors} tensors, {result.total_bytes / 1e9:.3f} GB in "
          f"{len(result.files)} file(s) to {result.dst} in {result.seconds:.1f} s ({rate:.2f} GB/s)")
    return 0
