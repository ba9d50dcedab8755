"""One place that decides, per operator, which implementation runs.

Order of preference:

* ``MS_DEEPSEEK_OPS=reference`` (environment) forces the plain-MindSpore reference
  for every operator (``MS_DEEPSEEK_OPS=kernel`` or unset: kernels where possible);
* device_target ``Ascend``: the Ascend C kernel, once ``ops/build_ascend.sh`` has
  installed the custom operator package (see :mod:`ms_deepseek.ops.ascend`);
* device_target ``CPU``: the C++ kernel, compiled with g++ on first use
  (:mod:`ms_deepseek.ops.build`);
* anything that cannot be built or loaded falls back to the reference, with one
  ``logging.warning`` per operator and process, except when the kernels were asked for:
  ``MS_DEEPSEEK_OPS=kernel`` on Ascend with a kernel not installed for the running SoC is a
  :class:`~ms_deepseek.core.errors.UserError` (one line), not a fallback.

The choice is made when the operator Cell is constructed; ``impl.kind`` on the
Cell says which one it got (``"reference"``, ``"cpu"`` or ``"ascend"``; ``"builtin"``: MindSpore's own
Softmax for a float32-only :class:`~ms_deepseek.ops.FP32Softmax` on Ascend, see its docstring).
"""

from __future__ import annotations

import logging
import os

LOG = logging.getLogger("ms_deepseek.ops")

OPS = ("expert_lookup", "fp32_softmax", "repetition_penalty")
ENV_VAR = "MS_DEEPSEEK_OPS"
_CHOICES = ("", "auto", "kernel", "reference")

_warned = set()


def warn_once(op_name: str, message: str) -> None:
    if op_name not in _warned:
        _warned.add(op_name)
        LOG.warning("%s: %s", op_name, message)


def _choice() -> str:
    value = os.environ.get(ENV_VAR, "").strip().lower()
    if value not in _CHOICES:
        from ms_deepseek.core.errors import UserError

        raise UserError(f"{ENV_VAR}={os.environ[ENV_VAR]!r}: expected 'reference' or 'kernel'")
    return value


def forced_reference() -> bool:
    return _choice() == "reference"


def kernels_required() -> bool:
    """``MS_DEEPSEEK_OPS=kernel``: a kernel that cannot be loaded is an error, not a fallback."""
    return _choice() == "kernel"


def device_target() -> str:
    import mindspore as ms

    return str(ms.get_context("device_target"))


def choose(op_name: str) -> str:
    """The implementation family for ``op_name`` on this process: reference, cpu or ascend."""
    if op_name not in OPS:
        raise ValueError(f"unknown operator {op_name!r}; known: {', '.join(OPS)}")
    if forced_reference():
        return "reference"
    target = device_target()
    if target == "Ascend":
        return "ascend"
    if target == "CPU":
        return "cpu"
    return "reference"


def _reference(op_name: str, **kwargs):
    from ms_deepseek.ops import reference

    cls = {
        "expert_lookup": reference.ExpertLookupReference,
        "fp32_softmax": reference.FP32SoftmaxReference,
        "repetition_penalty": reference.RepetitionPenaltyReference,
    }[op_name]
    return cls(**kwargs)


def _cpu(op_name: str, **kwargs):
    from ms_deepseek.ops import build, cpu

    lib = build.build(op_name)
    cls = {
        "expert_lookup": cpu.ExpertLookupCpu,
        "fp32_softmax": cpu.FP32SoftmaxCpu,
        "repetition_penalty": cpu.RepetitionPenaltyCpu,
    }[op_name]
    return cls(lib, **kwargs)


def _ascend(op_name: str, **kwargs):
    from ms_deepseek.ops import ascend

    return ascend.make(op_name, **kwargs)


def make(op_name: str, **kwargs):
    """Build the implementation Cell for ``op_name`` on the current backend."""
    from ms_deepseek.core.errors import UserError

    kind = choose(op_name)
    if kind != "reference":
        try:
            return _cpu(op_name, **kwargs) if kind == "cpu" else _ascend(op_name, **kwargs)
        except UserError:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure to build/load means: use the reference
            first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            if kind == "ascend" and kernels_required():
                raise UserError(f"{ENV_VAR}=kernel: {op_name}: {first_line}") from None
            warn_once(op_name, f"{kind} kernel unavailable ({first_line}); using the reference implementation")
    return _reference(op_name, **kwargs)
