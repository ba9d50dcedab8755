"""``ms-deepseek <command>``: one entry point, each command in its own module.

Commands are imported only when used, so ``ms-deepseek --help`` and the light
commands (plan, report, doctor) start without paying for MindSpore's import.

The convention every command follows: its module exposes ``add_arguments(parser)``
and ``run(args) -> int`` and nothing else for the command line (no ``main`` of its own,
no error handling: this file does it once). A new command is one line in
:data:`COMMANDS`. A :class:`~ms_deepseek.core.errors.UserError` becomes one ``error: ...``
line and exit 2.

Every command also takes ``--verbose``: without it MindSpore prints errors only
(``GLOG_v=3``, unless you set ``GLOG_v`` yourself; :mod:`ms_deepseek.core.runtime`).
"""

from __future__ import annotations

import argparse
import errno
import importlib
import os
import sys
from typing import List, Optional

from ms_deepseek import __version__
from ms_deepseek.core.errors import UserError
from ms_deepseek.core.runtime import quiet_defaults

# name -> (module, one-line help)
COMMANDS = {
    "train": ("ms_deepseek.cli.train", "train a recipe in this process (one worker)"),
    "launch": ("ms_deepseek.cli.launch", "build and run the msrun command for a recipe's parallel layout"),
    "prepare-data": ("ms_deepseek.cli.prepare_data", "tokenize jsonl / parquet / text into MindRecord shards"),
    "convert": ("ms_deepseek.cli.convert", "convert checkpoints between HuggingFace and ms_deepseek layouts"),
    "plan": ("ms_deepseek.cli.plan", "size a parallel layout for N NPUs: memory, traffic, tokens/s"),
    "export-lora": ("ms_deepseek.cli.export_lora", "export a LoRA run as a PEFT adapter, or merged into a base"),
    "generate": ("ms_deepseek.cli.generate", "generate text from a checkpoint (latent KV cache)"),
    "doctor": ("ms_deepseek.cli.doctor", "preflight checks for a host / node / cluster"),
    "report": ("ms_deepseek.cli.report", "HTML health report of a training run, with alerts"),
}


def _top_parser() -> argparse.ArgumentParser:
    lines = [f"  {name:<14}{help_}" for name, (_, help_) in COMMANDS.items()]
    parser = argparse.ArgumentParser(
        prog="ms-deepseek",
        description="Train, convert and serve DeepSeek-V2 models with MindSpore (Ascend and CPU).",
        epilog="commands:\n" + "\n".join(lines) + "\n\nRun 'ms-deepseek <command> --help' for a command's options.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"ms-deepseek {__version__}")
    parser.add_argument("command", nargs="?", help="one of: " + ", ".join(COMMANDS))
    return parser


def _close_progress_bars() -> None:
    """Clear any live tqdm bar so the error line does not start with a bar fragment."""
    tqdm_module = sys.modules.get("tqdm")
    if tqdm_module is None:
        return
    for bar in list(getattr(tqdm_module.tqdm, "_instances", ())):
        try:
            bar.leave = False  # close() then erases the bar's line instead of keeping it
            bar.close()
        except Exception:  # noqa: BLE001  (a half-built bar must not hide the user's error)
            pass


def main(argv: Optional[List[str]] = None) -> int:
    """Run a command; ``argv`` None: this process's own command line (the console script, ``python -m``), and
    the command owns the process (``args.owns_process``: per-process state such as MindSpore's compile cache)."""
    owns_process = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    top = _top_parser()
    if not argv or argv[0] in ("-h", "--help"):
        top.print_help()
        return 0
    if argv[0] == "--version":
        top.parse_args(argv)
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"ms-deepseek: error: unknown command {name!r}; choose from {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    module_name, help_ = COMMANDS[name]
    quiet_defaults(verbose="--verbose" in rest)  # before the command's module imports MindSpore
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser(prog=f"ms-deepseek {name}", description=help_[0].upper() + help_[1:] + ".")
    module.add_arguments(parser)
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="show MindSpore's warnings and MindFormers' output (default: errors only)",
    )
    args = parser.parse_args(rest)
    args.owns_process = owns_process
    try:
        return int(module.run(args) or 0)
    except UserError as exc:
        _close_progress_bars()
        print(f"ms-deepseek {name}: error: {exc}", file=sys.stderr)
        return 2
    except RecursionError:  # a parser not routed through safe_io met a runaway-nested input
        _close_progress_bars()
        print(f"ms-deepseek {name}: error: an input file is nested too deeply to parse", file=sys.stderr)
        return 2
    except BrokenPipeError:  # output piped into `head` and closed: not an error of ours (before OSError, its base)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as exc:
        if exc.errno != errno.ENAMETOOLONG:
            raise
        # a name taken from an input (a recipe's model.source, an index's shard) longer than the file system
        # allows: the input is at fault, whichever lookup met it first
        _close_progress_bars()
        shown = str(exc.filename or "")
        shown = shown if len(shown) <= 120 else shown[:60] + "..." + shown[-40:]
        print(
            f"ms-deepseek {name}: error: {shown}: file name too long for the file system (a name from an input file?)",
            file=sys.stderr,
        )
        return 2
    except KeyboardInterrupt:
        print(f"ms-deepseek {name}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
