"""Small things a newcomer meets: doctor on a host without swap, export-lora's base path of a random-base
run, a resumed scalar optimizer tensor keeping its shape."""

from pathlib import Path

import numpy as np


def test_swappiness_is_not_a_warning_without_swap():
    from ms_deepseek.diagnostics import doctor_host  # noqa: F401  (registers the host checks)
    from ms_deepseek.diagnostics.doctor_core import PASS, REGISTRY, WARN, DoctorContext, run_check
    from ms_deepseek.diagnostics.probe import RecordedProbe

    def result(swap_kb):
        probe = RecordedProbe(
            files={
                "/proc/sys/vm/swappiness": "60\n",
                "/proc/meminfo": f"MemTotal: 1000 kB\nSwapTotal:       {swap_kb} kB\n",
            }
        )
        return run_check(REGISTRY["swappiness"], DoctorContext(probe=probe))

    none = result(0)
    assert none.status == PASS and "no swap" in none.message
    assert result(4 * 1024**2).status == WARN


def test_export_lora_records_an_absolute_random_base(tmp_path, monkeypatch):
    from ms_deepseek.model.lora_export import run_base

    step = tmp_path / "runs" / "r" / "checkpoints" / "step_00000002"
    step.mkdir(parents=True)
    (tmp_path / "runs" / "r" / "base").mkdir()
    (tmp_path / "runs" / "r" / "base" / "model.safetensors").write_bytes(b"")
    monkeypatch.chdir(tmp_path)
    base = run_base(Path("runs/r/checkpoints/step_00000002"), {"source": "tiny"})
    assert base.is_absolute() and base == (tmp_path / "runs" / "r" / "base").resolve()


def test_a_scalar_optimizer_tensor_stays_a_scalar_after_restore(tmp_path):
    """restore_into (resume) of loss_scale / global_step: shape () in the model and so in the next save."""
    import mindspore as ms
    from mindspore import Parameter, Tensor
    from safetensors.numpy import save_file

    from ms_deepseek.checkpoint.safetensors_io import read_header
    from ms_deepseek.checkpoint.slice_readers import WholeSource
    from ms_deepseek.checkpoint.tensors import restore_into

    save_file(
        {"loss_scale": np.array(1024.0, np.float32), "global_step": np.array(7, np.int32)},
        str(tmp_path / "optimizer.safetensors"),
    )
    src = WholeSource(read_header(tmp_path / "optimizer.safetensors").tensors, None, tmp_path, hf=False)
    params = {
        "loss_scale": Parameter(Tensor(1.0, ms.float32), name="loss_scale", requires_grad=False),
        "global_step": Parameter(Tensor(0, ms.int32), name="global_step", requires_grad=False),
    }
    restore_into(params, src, "optimizer")
    assert params["loss_scale"].shape == () and float(params["loss_scale"].asnumpy()) == 1024.0
    assert params["global_step"].shape == () and int(params["global_step"].asnumpy()) == 7


def test_a_plan_search_says_what_it_is_doing_before_it_does_it(capsys):
    """A `plan --model ... --npus N` search says on its first stderr line how many layouts it estimates, also
    through a pipe (the progress bar draws only on a terminal), before the layout it prints."""
    from bad_input_helpers import run_cli

    code, out, err = run_cli(
        capsys, ["plan", "--model", "tiny", "--npus", "4", "--seq-len", "64", "--global-batch", "8"]
    )
    assert code in (0, 1), err
    first = err.strip().splitlines()[0]
    assert first.startswith("plan: estimating ") and first.endswith(" layouts of 4 NPUs ..."), err
    assert out.startswith("layout: ")
