"""Which installed Ascend kernels count: MindSpore's rule (only the running SoC's op-info file,
``mindspore/ops/operations/_custom_ops_utils.py``, ``CustomInfoGenerator._get_op_json``), and
``MS_DEEPSEEK_OPS=kernel`` failing loudly when the kernels are not installed for this SoC.

No NPU here: the SoC and device target are patched; the files are laid out as CANN's
installer writes them (tests/helpers/cann_stub.py builds them for real in tests/repo/test_build_ascend.py).
"""

import json
import logging

import mindspore.ops.operations._custom_ops_utils as custom_utils
import pytest

from ms_deepseek.core.errors import UserError
from ms_deepseek.ops import ascend, backend

from cann_stub import FakeAscendContext

OP_TYPES = {"ExpertLookup", "Fp32Softmax", "RepetitionPenalty"}


def install_vendor(root, soc, ops=OP_TYPES):
    config = root / "op_impl" / "ai_core" / "tbe" / "config" / soc
    config.mkdir(parents=True)
    info = {
        op: {
            "input0": {"name": "x", "dtype": "float32", "format": "ND", "paramType": "required"},
            "output0": {"name": "y", "dtype": "float32", "format": "ND", "paramType": "required"},
        }
        for op in ops
    }
    (config / f"aic-{soc}-ops-info.json").write_text(json.dumps(info))
    return root


@pytest.fixture
def opp(tmp_path, monkeypatch):
    opp = tmp_path / "opp"
    for soc in ("ascend910b", "ascend910_93"):
        (opp / "built-in" / "op_impl" / "ai_core" / "tbe" / "config" / soc).mkdir(parents=True)
    (opp / "vendors").mkdir()
    monkeypatch.setenv("ASCEND_OPP_PATH", str(opp))
    monkeypatch.delenv("ASCEND_CUSTOM_OPP_PATH", raising=False)
    return opp


def both(monkeypatch, soc):
    """installed_op_types() and MindSpore's own lookup, on the same SoC."""
    monkeypatch.setattr(custom_utils, "MSContext", FakeAscendContext(soc))
    monkeypatch.setattr(ascend, "soc_version", lambda: soc)
    found = set()
    for op in sorted(OP_TYPES):
        try:
            custom_utils.CustomInfoGenerator(op)._get_op_json()
            found.add(op)
        except RuntimeError:
            pass
    return ascend.installed_op_types(), found


def test_only_the_running_socs_folder_counts(tmp_path, opp, monkeypatch):
    vendor = install_vendor(tmp_path / "vendor", "ascend910b")
    monkeypatch.setenv("ASCEND_CUSTOM_OPP_PATH", f"{tmp_path}/missing:{vendor}")
    assert both(monkeypatch, "ascend910b") == (OP_TYPES, OP_TYPES)
    assert both(monkeypatch, "ascend910_93") == (set(), set())  # built for 910B, running on A3


def test_vendors_count_only_through_config_ini(tmp_path, opp, monkeypatch):
    install_vendor(opp / "vendors" / "ms_deepseek", "ascend910b")
    assert both(monkeypatch, "ascend910b") == (set(), set())  # not listed in vendors/config.ini
    (opp / "vendors" / "config.ini").write_text("load_priority=other, ms_deepseek\n")
    assert both(monkeypatch, "ascend910b") == (OP_TYPES, OP_TYPES)


def test_off_ascend_nothing_counts(tmp_path, opp, monkeypatch):
    monkeypatch.setenv("ASCEND_CUSTOM_OPP_PATH", str(install_vendor(tmp_path / "vendor", "ascend910b")))
    monkeypatch.setattr(ascend, "soc_version", lambda: "")
    assert ascend.installed_op_types() == set()


@pytest.fixture
def on_ascend_910_93(tmp_path, opp, monkeypatch):
    """A host that reports Ascend / ascend910_93 with kernels installed for ascend910b only."""
    monkeypatch.setenv("ASCEND_CUSTOM_OPP_PATH", str(install_vendor(tmp_path / "vendor", "ascend910b")))
    monkeypatch.setattr(ascend, "soc_version", lambda: "ascend910_93")
    monkeypatch.setattr(backend, "device_target", lambda: "Ascend")
    monkeypatch.setattr(backend, "_warned", set())


def test_kernels_asked_for_but_not_installed_for_this_soc_fail_in_one_line(on_ascend_910_93, monkeypatch):
    monkeypatch.setenv("MS_DEEPSEEK_OPS", "kernel")
    with pytest.raises(UserError) as err:
        backend.make("repetition_penalty")
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith(
        "MS_DEEPSEEK_OPS=kernel: repetition_penalty: Ascend custom operator RepetitionPenalty "
        "is not installed for this SoC (ascend910_93)"
    )
    assert "ops/build_ascend.sh --soc ascend910_93" in msg


def test_a_soc_the_operators_are_not_built_for_is_named_as_such(on_ascend_910_93, monkeypatch):
    """On a SoC no OpDef registers, the message does not send the user to a build the script refuses."""
    monkeypatch.setenv("MS_DEEPSEEK_OPS", "kernel")
    monkeypatch.setattr(ascend, "soc_version", lambda: "ascend310p")
    with pytest.raises(UserError) as err:
        backend.make("fp32_softmax")
    assert str(err.value) == (
        "MS_DEEPSEEK_OPS=kernel: fp32_softmax: Ascend custom operator Fp32Softmax is not "
        "available for this SoC (ascend310p): the operators are built for ascend910b and "
        "ascend910_93 only"
    )


def test_without_the_request_a_mismatch_falls_back_with_a_warning(on_ascend_910_93, monkeypatch, caplog):
    monkeypatch.delenv("MS_DEEPSEEK_OPS", raising=False)
    with caplog.at_level(logging.WARNING, logger="ms_deepseek.ops"):
        impl = backend.make("repetition_penalty")
    assert impl.kind == "reference"
    assert "not installed for this SoC (ascend910_93)" in caplog.text
