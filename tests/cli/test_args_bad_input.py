"""The argparse validators of ms_deepseek/cli/args.py the commands share: what they accept and their bounds."""

import argparse

import pytest

from ms_deepseek.cli import args as cli_args


@pytest.mark.parametrize("good", ["127.0.0.1", "::1", "node-0", "node0.cluster.local", "10.1.2.3"])
def test_host_accepts_real_addresses(good):
    assert cli_args.host(good) == good


def test_validators_bounds():
    assert cli_args.port("1") == 1 and cli_args.port("65535") == 65535
    assert cli_args.positive_float("0.5") == 0.5 and cli_args.non_negative_int("0") == 0
    for fn, text in (
        (cli_args.port, "65536"),
        (cli_args.positive_float, "0"),
        (cli_args.positive_int, "1.5"),
        (cli_args.non_negative_float, "-0.1"),
        (cli_args.positive_float, "inf"),
    ):
        with pytest.raises(argparse.ArgumentTypeError):
            fn(text)
