"""LayerOps on the fused C kernels: residual add + RMSNorm and rotary embedding in place.

Each call is one ctypes call on the tensors' memory where the torch path makes five or six
torch calls. The kernels are single-threaded, so batches above ``MAX_ROWS`` rows (prefill
chunks, big decode batches), where torch's multi-threaded ops win, and layouts the kernels
do not take go to the torch path.
"""

from __future__ import annotations

import ctypes

import torch

from engine.layers import LayerOps

MAX_ROWS = 64
_INT, _PTR = ctypes.c_int64, ctypes.c_void_p
_SIGNATURES = {
    "add_rms_norm": [_PTR, _PTR, _PTR, _INT, _INT, ctypes.c_float],
    "rotary": [_PTR, _INT, _INT, _INT, _INT, _PTR, _PTR],
}
_SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}


class NativeLayerOps(LayerOps):
    name = "cpu-native"

    def __init__(self, library: ctypes.CDLL, dtype: torch.dtype):
        self.dtype = dtype
        self.max_rotary_dim = library.max_rotary_dim()
        suffix = _SUFFIX[dtype]
        self._norm, self._rotary = (self._bind(library, f"{name}_{suffix}", args)
                                    for name, args in _SIGNATURES.items())

    @staticmethod
    def _bind(library, symbol, argtypes):
        function = getattr(library, symbol)
        function.argtypes, function.restype = argtypes, None
        return function

    def rms_norm(self, norm, x, residual=None):
        if (residual is None or x.dtype != self.dtype or x.dim() != 2 or x.shape[0] > MAX_ROWS
                or not (x.is_contiguous() and residual.is_contiguous() and residual.dtype == self.dtype)):
            return super().rms_norm(norm, x, residual)
        self._norm(x.data_ptr(), residual.data_ptr(), norm.weight.data_ptr(), x.shape[0], x.shape[1], norm.eps)
        return x, residual

    def rotary_qkv(self, qkv, num_heads, num_kv_heads, head_dim, cos_sin):
        cos, sin = cos_sin
        if (qkv.dtype != self.dtype or qkv.shape[0] > MAX_ROWS or qkv.stride(-1) != 1
                or head_dim > self.max_rotary_dim or not (cos.is_contiguous() and sin.is_contiguous())):
            return super().rotary_qkv(qkv, num_heads, num_kv_heads, head_dim, cos_sin)
        self._rotary(qkv.data_ptr(), qkv.shape[0], qkv.stride(0), num_heads + num_kv_heads, head_dim,
                     cos.data_ptr(), sin.data_ptr())
        return qkv.view(qkv.shape[0], -1, head_dim).split([num_heads, num_kv_heads, num_kv_heads], dim=1)
