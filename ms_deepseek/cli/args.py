"""The command line's shared pieces: argparse ``type=`` validators (finite numbers, ranges, ports,
host names) and :func:`resolve_layout`, the one reading of ``--recipe`` / ``--dp --tp --ep --pp``."""

from __future__ import annotations

import argparse
import re
import socket

from ms_deepseek.core.errors import UserError


def _number(kind, text: str):
    try:
        value = kind(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def positive_float(text: str) -> float:
    value = _number(float, text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def non_negative_float(text: str) -> float:
    value = _number(float, text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def positive_int(text: str) -> int:
    value = _number(int, text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a whole number > 0, got {text}")
    return value


def positive_int_at_most(limit: int, what: str):
    """A ``type=`` for a whole number in 1..limit (ms_deepseek.core.schema's sane bounds), named in the error."""

    def parse(text: str) -> int:
        value = positive_int(text)
        if value > limit:
            raise argparse.ArgumentTypeError(
                f"{text if len(text) <= 20 else text[:20] + '...'} is more than {limit} ({what})"
            )
        return value

    parse.__name__ = "positive_int"
    return parse


def non_negative_int(text: str) -> int:
    value = _number(int, text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 0, got {text}")
    return value


def port(text: str) -> int:
    value = _number(int, text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a TCP port is 1..65535, got {text}")
    return value


_HOSTNAME = re.compile(
    r"^(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?$"
)


def host(text: str) -> str:
    """An IPv4/IPv6 address or a syntactically valid host name (not resolved here)."""
    value = text.strip()
    if not value:
        raise argparse.ArgumentTypeError("empty address")
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            socket.inet_pton(family, value)
            return value
        except OSError:
            pass
    if re.fullmatch(r"[0-9.]+", value) or not _HOSTNAME.match(value):
        raise argparse.ArgumentTypeError(f"not an IP address or host name: {text!r}")
    return value


LAYOUT_FLAGS = ("dp", "tp", "pp", "ep")


def resolve_layout(args: argparse.Namespace, base):
    """``base`` (a ParallelConfig: a recipe's ``parallel`` section, or the default) with the command
    line's ``--dp/--tp/--pp/--ep`` (and ``--micro-batches`` where the command has it) applied: the one
    reading of those flags, for ``convert`` and ``plan``.

    A changed ``pp`` drops the recipe's ``stage_layers`` (cut for its own pp) and raises
    ``micro_batches`` to at least one per stage (1F1B); a changed ``ep`` drops its
    ``expert_placement`` (a table for its own ep)."""
    import dataclasses

    changes = {k: getattr(args, k) for k in LAYOUT_FLAGS if getattr(args, k, None) is not None}
    if getattr(args, "micro_batches", None) is not None:
        changes["micro_batches"] = args.micro_batches
    if not changes:
        return base
    for key, value in changes.items():
        if value < 1:
            raise UserError(f"--{key.replace('_', '-')}: must be >= 1, got {value}")
    pp, ep = changes.get("pp", base.pp), changes.get("ep", base.ep)
    if "micro_batches" not in changes and pp > 1 and base.micro_batches < pp:
        changes["micro_batches"] = pp
    if pp != base.pp:
        changes["stage_layers"] = None
    if ep != base.ep:
        changes["expert_placement"] = None
    return dataclasses.replace(base, **changes)


def arg(*flags, **kwargs):
    """One row of a command's argument table: what ``parser.add_argument`` takes."""
    return flags, kwargs


def add_all(parser: argparse.ArgumentParser, table) -> None:
    """Add a command's argument table (rows of :func:`arg`) to its parser, in order."""
    for flags, kwargs in table:
        parser.add_argument(*flags, **kwargs)


def overrides_arg(help_text: str):
    """The ``--set SECTION.KEY=VALUE`` row: recipe overrides, repeatable, into ``args.overrides``."""
    return arg("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE", help=help_text)
