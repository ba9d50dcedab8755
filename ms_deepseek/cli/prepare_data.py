"""``ms-deepseek prepare-data``: tokenize a corpus into MindRecord shards for training."""

from __future__ import annotations

import argparse

from ms_deepseek.core.errors import UserError

_EPILOG = """\
inputs:
  .jsonl    one JSON object per line: {"text": ...} (pretrain), or
            {"messages": [{"role": "system|user|assistant", "content": ...}, ...]}
            or {"prompt": ..., "response": ...} (sft)
  .parquet  the same fields as columns
  any other file: plain UTF-8 text, one pretraining document per file
  folders are read recursively in sorted order (hidden files skipped)

pretrain: documents become [bos] text [eos], joined and cut into seq-len windows.
sft: one conversation per sample in the DeepSeek-V2-Chat template; only the
assistant replies (and their eos) are trained on; longer ones are truncated
(counted in the summary).

examples:
  ms-deepseek prepare-data corpus/ --tokenizer ckpt/DeepSeek-V2-Lite --seq-len 4096 --output data/pt
  ms-deepseek prepare-data chats.jsonl --format sft --tokenizer ckpt/ --seq-len 2048 --output data/sft
  ms-deepseek prepare-data --embedded-default --output data/default
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = _EPILOG
    parser.add_argument("inputs", nargs="*", metavar="INPUT", help="jsonl / parquet / text files or folders")
    parser.add_argument(
        "--output",
        "-o",
        required=True,
        metavar="DIR",
        help="folder to create (shards, meta.json, a copy of the tokenizer)",
    )
    parser.add_argument(
        "--tokenizer",
        metavar="PATH",
        help="tokenizer.json, sentencepiece .model, or a folder holding one (e.g. a checkpoint)",
    )
    parser.add_argument(
        "--seq-len",
        type=int,
        metavar="N",
        help="tokens per sample (required for INPUTs; default 256 with --embedded-default)",
    )
    parser.add_argument(
        "--format",
        choices=("pretrain", "sft"),
        default="pretrain",
        help="pretrain: packed windows (default); sft: one conversation per sample",
    )
    parser.add_argument("--num-shards", type=int, default=1, metavar="K", help="MindRecord shard files (default 1)")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty --output folder")
    parser.add_argument(
        "--embedded-default",
        action="store_true",
        help="build the embedded default corpus (Python standard library sources) with its own "
        "sentencepiece tokenizer instead of reading INPUTs",
    )
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=8192,
        metavar="V",
        help="--embedded-default: tokenizer vocabulary (default 8192)",
    )
    parser.add_argument(
        "--max-bytes",
        type=int,
        default=12_000_000,
        metavar="B",
        help="--embedded-default: text to take from the standard library (default 12000000)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    from ms_deepseek.data.prepare import prepare_data, prepare_embedded_default

    progress = not args.no_progress
    if args.embedded_default:
        if args.inputs or args.tokenizer:
            raise UserError("--embedded-default builds its own corpus and tokenizer; drop INPUTs and --tokenizer")
        if args.format != "pretrain":
            raise UserError("--embedded-default: the embedded corpus is pretraining text (--format pretrain)")
        _, summary = prepare_embedded_default(
            args.output,
            seq_len=args.seq_len or 256,
            vocab_size=args.vocab_size,
            max_bytes=args.max_bytes,
            num_shards=args.num_shards,
            overwrite=args.overwrite,
            progress=progress,
        )
    else:
        if not args.inputs:
            raise UserError("no INPUT given (or use --embedded-default)")
        if args.tokenizer is None:
            raise UserError("--tokenizer: required with INPUTs")
        if args.seq_len is None:
            raise UserError("--seq-len: required with INPUTs")
        _, summary = prepare_data(
            args.inputs,
            args.output,
            args.tokenizer,
            args.seq_len,
            fmt=args.format,
            num_shards=args.num_shards,
            overwrite=args.overwrite,
            progress=progress,
        )
    print(summary)
    return 0
