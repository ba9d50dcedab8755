"""Inputs of the NPU tests (``tests/ascend/test_ops_ascend.py``) chosen to reach a path of the kernels'
910B schedule that smaller inputs never take; ``tests/unit/ops/test_ops_tiling.py`` checks on CPU, with
the same tiling code, that they do."""

# FP32Softmax [rows, cols]: some core's last row tile is shorter than rows_per_tile, so the SoftMax
# API re-derives its split on the device for that tile (SoftmaxConfig::isCheckTiling, asc-devkit
# v9.0.0 docs/api/context/SoftMax.md) instead of using the host's SoftMaxTilingFunc result as is.
SOFTMAX_SHORT_LAST_TILE = [(100, 203), (64, 2048), (128, 4096)]

# RepetitionPenalty (batch, vocab, ids per row): more ids than one UB load (``id_tile``, a quarter of
# UB), so every tile streams the row's ids in id_tile pieces (the general path, not the "fast" one).
PENALTY_IDS_STREAMED = [(2, 102400, 16384), (3, 4099, 12500)]
