"""numba kernels: serial, ``nogil``, deterministic and batch-invariant.

``quant_matmul``: ``y[T, O] = x[T, I] @ W.T`` straight from every storage format of
:mod:`storage.quant` (int4 grouped / per row, int8, bf16, f16, f32). Each public function is a
typed wrapper that checks dtypes, shapes and contiguity (``ValueError``) around a private kernel.

Shape legend: see ``runtime.kernels.quant_matmul``.
"""

from runtime.kernels.quant_matmul import (
    DEFAULT_PREFETCH,
    matmul_bf16,
    matmul_f16,
    matmul_f32,
    matmul_int4,
    matmul_int8,
)

__all__ = [
    "DEFAULT_PREFETCH",
    "matmul_bf16",
    "matmul_f16",
    "matmul_f32",
    "matmul_int4",
    "matmul_int8",
]
