"""The Mamba2 mixer every Mamba2 family shares (Mamba2, and the hybrids' Mamba layers: Bamba,
Nemotron-H, Granite-4.0-H, Falcon-H1): ``in_proj`` to the gate z, the convolved x|B|C and dt;
the causal convolution and selective scan over this layer's per-request state slots
(:meth:`LayerOps.causal_conv1d`, :meth:`LayerOps.ssm_scan`); a gated RMSNorm per group of
heads; ``out_proj``. Parameter names are Hugging Face's (``conv1d.weight`` [C, 1, K],
``A_log``, ``D``, ``dt_bias``, ``norm.weight``), so checkpoints load as they are."""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from engine.interfaces.model import MambaState, StepContext
from engine.layers.linear import Linear
from engine.layers.module import Layer
from engine.layers.ops import LayerOps
from engine.layers.ssm import SSMParams


@attrs.frozen
class Mamba2Shape:
    """A Mamba2 mixer's sizes, read from a family's config by the family."""

    hidden_size: int
    num_heads: int
    head_dim: int
    state_size: int
    n_groups: int
    conv_kernel: int
    chunk_size: int
    eps: float
    conv_bias: bool = True
    proj_bias: bool = False
    dt_limit: tuple[float, float] = (0.0, float("inf"))

    @property
    def intermediate(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.intermediate + 2 * self.n_groups * self.state_size

    @property
    def state(self) -> MambaState:
        """What a request's slot holds (``AttentionKind(state=...)`` of the mixer's layer)."""
        return MambaState(self.conv_dim, self.conv_kernel, self.num_heads, self.head_dim, self.state_size)


class _Conv1d(Layer):
    """The depthwise convolution's weights under HF's names (the op convolves)."""

    def __init__(self, channels: int, kernel: int, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(channels, dtype=dtype), requires_grad=False) if bias else None


class GatedRMSNorm(Layer):
    """RMSNorm of y · silu(z) over each of ``groups`` equal slices of the channels (Mamba2's
    ``norm_before_gate=False``), computed in float32."""

    def __init__(self, size: int, groups: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)
        self.groups, self.eps = groups, eps

    def forward(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        gated = (y.float() * F.silu(gate.float())).unflatten(-1, (self.groups, -1))
        normed = gated * torch.rsqrt(gated.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.flatten(-2).to(y.dtype)


class Mamba2Mixer(Layer):
    """A Mamba2 layer (``layer``: its index, where its state slots are in ``step.kv_caches``):
    hidden [T, hidden] -> [T, hidden]."""

    def __init__(self, shape: Mamba2Shape, layer: int, method, dtype: torch.dtype, ops: LayerOps):
        super().__init__()
        self.shape, self.layer, self.ops = shape, layer, ops
        s = shape
        self.in_proj = Linear(
            s.hidden_size, [s.intermediate + s.conv_dim + s.num_heads], s.proj_bias, method, dtype
        )
        self.conv1d = _Conv1d(s.conv_dim, s.conv_kernel, s.conv_bias, dtype)
        self.dt_bias = nn.Parameter(torch.empty(s.num_heads, dtype=dtype), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(s.num_heads, dtype=dtype), requires_grad=False)
        self.D = nn.Parameter(torch.empty(s.num_heads, dtype=dtype), requires_grad=False)
        self.norm = GatedRMSNorm(s.intermediate, s.n_groups, s.eps, dtype)
        self.out_proj = Linear(s.intermediate, [s.hidden_size], s.proj_bias, method, dtype)

    def forward(self, hidden: torch.Tensor, step: StepContext) -> torch.Tensor:
        s, tokens = self.shape, hidden.shape[0]
        _, layout = step.layer_attention(self.layer)
        conv_states, ssm_states = s.state.views(step.kv_caches[self.layer])
        gate, xbc, dt = self.in_proj(hidden).split([s.intermediate, s.conv_dim, s.num_heads], dim=-1)
        conv = self.conv1d
        xbc = self.ops.causal_conv1d(xbc, conv.weight[:, 0], conv.bias, conv_states, layout)
        x, b, c = xbc.split([s.intermediate, s.n_groups * s.state_size, s.n_groups * s.state_size], dim=-1)
        y = self.ops.ssm_scan(
            x.reshape(tokens, s.num_heads, s.head_dim),
            dt,
            b.reshape(tokens, s.n_groups, s.state_size),
            c.reshape(tokens, s.n_groups, s.state_size),
            self._params(),
            ssm_states,
            layout,
        )
        return self.out_proj(self.norm(y.reshape(tokens, s.intermediate), gate))

    def _params(self) -> SSMParams:
        return SSMParams(
            -torch.exp(self.A_log.float()), self.D, self.dt_bias, self.shape.dt_limit, self.shape.chunk_size
        )
