"""Process set-up shared by every command: which device to run on, and how much the
libraries underneath may print.

* :func:`detect_device` is the one place that decides CPU or Ascend (the trainer, the
  doctor's smoke run and the benchmarks ask it); :func:`use_device` applies it with
  ``mindspore.set_device`` (``set_context(device_target=...)`` is deprecated in 2.9).
* :func:`quiet_defaults` makes MindSpore print errors only (``GLOG_v=3``) unless the user
  set ``GLOG_v`` or asked for ``--verbose``; it must run before ``import mindspore``,
  which reads the variable once (its Python logger and the C++ glog alike).
"""

from __future__ import annotations

import os
import shutil
from typing import Optional

from ms_deepseek.core.errors import UserError

DEVICE_ENV = "MS_DEEPSEEK_DEVICE"
DEVICES = ("CPU", "Ascend")
VERBOSE_ENV = "MS_DEEPSEEK_VERBOSE"  # set by --verbose; msrun workers inherit it


def detect_device() -> str:
    """``MS_DEEPSEEK_DEVICE`` if set, else Ascend on a host with NPUs (``npu-smi``) and CANN's
    environment (``ASCEND_HOME_PATH``), else CPU."""
    from ms_deepseek.core.errors import UserError

    forced = os.environ.get(DEVICE_ENV)
    if forced:
        if forced not in DEVICES:
            raise UserError(f"{DEVICE_ENV}={forced!r}: expected one of {', '.join(DEVICES)}")
        return forced
    if shutil.which("npu-smi") and os.environ.get("ASCEND_HOME_PATH"):
        return "Ascend"
    return "CPU"


# The MindSpore release lines ms-deepseek runs on, the default first: requirements.txt pins the default (2.9.0),
# requirements-ms<line>.txt each other line (setup.py installs one when MS_DEEPSEEK_MINDSPORE=<line> is set). The
# compile and execution checks (plan --compile / --execute) load MindSpore's Ascend plugin against stub CANN
# libraries generated from the installed wheel (verification/cann_stubs.py); a line they were not run on is refused
# at start rather than trained on unchecked (README: which releases and why).
SUPPORTED_MINDSPORE_LINES = ("2.9", "2.10")
MINDSPORE_LINE_ENV = "MS_DEEPSEEK_MINDSPORE"  # read by setup.py at install time


def mindspore_line(version: str) -> str:
    """``major.minor`` of a MindSpore version string (``2.10.0+cpu`` -> ``2.10``)."""
    return ".".join(version.split("+")[0].split(".")[:2])


def pins_file(line: str) -> str:
    """The pins file of a supported line (requirements.txt for the default)."""
    return "requirements.txt" if line == SUPPORTED_MINDSPORE_LINES[0] else f"requirements-ms{line}.txt"


def check_mindspore_version(found: Optional[str] = None) -> str:
    """The installed MindSpore's line; one line, no traceback, when it is not one of
    :data:`SUPPORTED_MINDSPORE_LINES`."""
    if found is None:
        from importlib.metadata import PackageNotFoundError, version

        try:
            found = version("mindspore")
        except PackageNotFoundError:
            raise UserError("MindSpore is not installed: pip install -r requirements.txt") from None
    line = mindspore_line(found)
    if line not in SUPPORTED_MINDSPORE_LINES:
        lines = " and ".join(f"{s}.x" for s in SUPPORTED_MINDSPORE_LINES)
        raise UserError(
            f"MindSpore {found}: ms-deepseek runs on MindSpore {lines} (its compile and execution checks are run on "
            f"those lines): pip install -e . for {SUPPORTED_MINDSPORE_LINES[0]}, or "
            f"{MINDSPORE_LINE_ENV}=<line> pip install -e . for another"
        )
    return line


def use_device(target: Optional[str] = None) -> str:
    """Run MindSpore on ``target`` (default: :func:`detect_device`); returns it. Refuses an unsupported MindSpore
    first (:func:`check_mindspore_version`)."""
    check_mindspore_version()
    import mindspore as ms

    target = target or detect_device()
    try:
        ms.set_device(target)
    except RuntimeError:
        # kernels already ran in this process (e.g. a test session that built a model first): the
        # runtime is up and can no longer be set; fine when it runs on the device asked for
        if ms.get_context("device_target") != target:
            raise
    return target


def is_verbose() -> bool:
    return os.environ.get(VERBOSE_ENV, "") not in ("", "0")


def quiet_defaults(verbose: bool = False) -> None:
    """Errors only from MindSpore unless ``verbose`` or the user's own ``GLOG_v``."""
    if verbose:
        os.environ[VERBOSE_ENV] = "1"
    if not (verbose or is_verbose()):
        os.environ.setdefault("GLOG_v", "3")


# MindSpore copies a parameter at each read (a ``TensorMove`` of each ``Load``) when the graph reads it more than
# once: the default of MS_DEV_SIDE_EFFECT_LOAD_ELIM ("1") copies every Load of a parameter whose ref key appears
# in more than one Load (mindspore/ccsrc/pipeline/jit/ps/static_analysis/order_enforce.cc,
# OrderEnforcer::GetSpecialLoads). The float32 update of weights stored in another dtype reads each weight a second
# time (train/optim.py AdamW._composite), so under the default every such weight is copied at the start of the step
# and the copy held until the last backward (MindSpore's level-1 accounting of v2-sft-64npu: docs/measurements.md).
# "3" inserts none (OrderEnforcer::Run returns before GetNeedInsertLoads); MindFormers sets it for its large
# models (its llama2-70b and telechat-115b instructions). It is exact for our step: a copy is needed only when a
# value read before a write is used after it, and every read of a weight in the step precedes its update
# (OrderEnforcer::HandleUpdateState orders a Load's users before the next side effect on the parameter, in every
# mode). tests/unit/train/test_weight_load_copies.py runs the pipeline step and the trainer in both modes: bit for
# bit the same. "2" copies only where one node takes two reads of a parameter, but its check (ReCheckUsersOfLoad)
# made a tp 2 / pp 2 toy of 8 layers compile at level 1 several times longer than the default (docs/measurements.md).
LOAD_COPIES_ENV = "MS_DEV_SIDE_EFFECT_LOAD_ELIM"
NO_LOAD_COPIES = "3"


def skip_parameter_load_copies() -> str:
    """Have MindSpore read parameters without copying them (``MS_DEV_SIDE_EFFECT_LOAD_ELIM=3``) unless the user set
    the variable; returns the value in force. MindSpore reads it once per process, when it compiles its first
    graph (a function-local static in ``OrderEnforcer::Run``): call this before that."""
    return os.environ.setdefault(LOAD_COPIES_ENV, NO_LOAD_COPIES)


# MindSpore's graph compiler refuses a graph whose function calls nest deeper than its recursion limit
# (default 1000: "Exceed function call depth limit"). The training step's nesting grows with the decoder
# layers, so with the default no model past ~16 layers compiled, on CPU or Ascend (a 20-layer tiny model
# failed in `ms-deepseek train`; V2-Lite has 27, V2 60). Measured on MindSpore 2.9.0 with the small model:
# 16 layers exceed 1000 and 20 layers compile under 2000, so a layer nests 60-100 calls; 120 per layer leaves a
# margin (tests/unit/train/test_deep_model_compiles.py). The deeper recursion needs C++ stack: 16 layers
# compiled in an eighth of Linux's default thread stack under MindSpore's dry run, so 60 layers stay within it.
CALL_DEPTH_PER_LAYER = 120
CALL_DEPTH_BASE = 1000  # MindSpore's default, for the embedding, the head, the loss and the optimizer


def allow_graph_depth(num_layers: int) -> int:
    """Raise MindSpore's recursion limit (``mindspore.set_recursion_limit``) for a model of ``num_layers``
    decoder layers before a graph is compiled; returns the limit set."""
    import mindspore as ms

    limit = CALL_DEPTH_BASE + CALL_DEPTH_PER_LAYER * int(num_layers)
    ms.set_recursion_limit(limit)
    return limit
