"""Layer: the base of the engine's model building blocks — an ``nn.Module`` whose call goes
straight to ``forward``.

``nn.Module.__call__`` spends two extra Python frames and a dozen hook checks on every call.
At batch 1 on the CPU a decoded token makes ~400 module calls between weight matmuls that
stream the whole model through the caches, so each call runs cold: skipping the hook
machinery saved 0.5 ms of an 8 ms step on the default model. The price is that torch
module hooks do not fire on these layers; plugins extend the engine through its interfaces,
never through hooks, so nothing here relies on them.
"""

from __future__ import annotations

from torch import nn


class Layer(nn.Module):
    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)
