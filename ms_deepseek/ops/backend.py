"""One place that decides, per operator, which implementation runs.

Order of preference:

* ``MS_DEEPSEEK_OPS=reference`` (environment) forces the plain-MindSpore reference;
* device_target ``Ascend``: the Ascend C kernel (built on a CANN host, see ``ops/``);
* device_target ``CPU``: the C++ kernel, compiled with g++ on first use;
* anything that cannot be built or loaded falls back to the reference, with one
  ``logging.warning`` per operator.
"""

from __future__ import annotations

import logging
import os

LOG = logging.getLogger("ms_deepseek.ops")

OPS = ("expert_lookup", "fp32_softmax", "repetition_penalty")
ENV_VAR = "MS_DEEPSEEK_OPS"

_warned = set()


def warn_once(op_name: str, message: str) -> None:
    if op_name not in _warned:
        _warned.add(op_name)
        LOG.warning("%s: %s", op_name, message)


def forced_reference() -> bool:
    return os.environ.get(ENV_VAR, "").strip().lower() == "reference"


def choose(op_name: str) -> str:
    """Return 'reference' for now (kernels are added behind this switch)."""
    if op_name not in OPS:
        raise ValueError(f"unknown operator {op_name!r}")
    return "reference"


def make(op_name: str, **kwargs):
    """Build the implementation Cell for ``op_name`` on the current backend."""
    from ms_deepseek.ops import reference

    choose(op_name)
    cls = {
        "expert_lookup": reference.ExpertLookupReference,
        "fp32_softmax": reference.FP32SoftmaxReference,
        "repetition_penalty": reference.RepetitionPenaltyReference,
    }[op_name]
    return cls(**kwargs)
