"""A checkpoint's scalar tensors keep their shape through a resume (checkpoint/tensors.py ``restore_into``)."""

import numpy as np


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
