"""Memory budgets of the predictives: Jacobian chunks (GLM) and weight-sample groups (NN).

Internal module.
"""

from __future__ import annotations

import torch

__all__ = ["JACOBIAN_CHUNK_BYTES", "NN_SAMPLE_BYTES", "jacobian_chunk_rows"]

#: Bytes of Jacobian held at once by the GLM predictive.
JACOBIAN_CHUNK_BYTES = 256 * 2**20

#: Memory of the weight samples and outputs ``pred_type="nn"`` holds at once (one sample at
#: least).
NN_SAMPLE_BYTES = 256 * 2**20


def jacobian_chunk_rows(n_outputs: int, n_params: int, dtype: torch.dtype) -> int:
    """Data points whose (rows, C, P) Jacobian fits in ``JACOBIAN_CHUNK_BYTES``, at least 1."""
    itemsize = torch.finfo(dtype).bits // 8
    return max(1, JACOBIAN_CHUNK_BYTES // max(1, n_outputs * n_params * itemsize))
