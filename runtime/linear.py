"""Linear layers over stored weights: ``y = x @ W.T`` for every storage format.

Interim numpy reference (dequantize + matmul); the numba kernels replace the body of
``Linear.__call__`` while keeping this interface.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from storage.quant import QTensor, dequantize

__all__ = ["Linear"]


class Linear:
    """A weight ``[O, I]`` in any storage format. Call with float32 ``x [T, I]`` -> ``[T, O]``."""

    def __init__(self, q: QTensor) -> None:
        self.q = q
        self.out_features, self.in_features = q.shape
        self._w = dequantize(q)

    @property
    def nbytes(self) -> int:
        return self.q.nbytes

    def __call__(self, x: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        return np.asarray(x, dtype=np.float32) @ self._w.T
