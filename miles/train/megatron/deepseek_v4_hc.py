"""DeepSeek-V4's manifold-constrained hyper-connections (mHC) as Megatron modules.

The maths is the engine's (miles/engine/hyper_connections.py); these modules hold its weights as
parameters. The residual stream of a DeepSeek-V4 decoder is N = `hc_mult` streams per token, [s, b, N, D] in
Megatron's sequence-first layout. Around each block (attention, then the MoE), a `HyperConnection`
reads the streams and gives three mixes, each from one linear map of the RMS-normed, flattened
streams (fp32):
- pre [N] = sigmoid(w_pre * scale_pre + b_pre) + eps: collapses the streams into the block's input;
- post [N] = 2 sigmoid(w_post * scale_post + b_post): spreads the block's output over the streams;
- comb [N, N] = softmax(w_comb * scale_comb + b_comb) + eps, made doubly stochastic by
  `hc_sinkhorn_iters` rounds of Sinkhorn-Knopp (columns first, then rows and columns in turn):
  mixes the input streams into the output ones.
The block's output then becomes the streams `post x out + comb^T streams` (`mix`): the post-mix is
applied to the block's *output* and added after the residual mix, the order AMD's DeepSeek-V4
alignment found reversed in a Megatron port. `HyperHead` collapses the streams once more before the
final norm. Parameter names are transformers' (`fn`, `base`, `scale`; `hc_fn`, `hc_base`,
`hc_scale`), so conversion maps them one to one. The weights are small and replicated on every
tensor-parallel rank (the streams are the full hidden size there).
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.transformer.module import MegatronModule

from miles.engine import hyper_connections as hc


class HyperConnection(MegatronModule):
    """One mHC site (module docstring): streams -> (post, comb, collapsed block input)."""

    def __init__(
        self, config: Any, hc_mult: int, sinkhorn_iters: int, hc_eps: float, norm_eps: float
    ) -> None:
        super().__init__(config=config)
        self.iters, self.hc_eps, self.norm_eps = sinkhorn_iters, hc_eps, norm_eps
        width = (2 + hc_mult) * hc_mult
        self.fn = torch.nn.Parameter(torch.empty(width, hc_mult * config.hidden_size, dtype=torch.float32))
        self.base = torch.nn.Parameter(torch.zeros(width, dtype=torch.float32))
        self.scale = torch.nn.Parameter(torch.ones(3, dtype=torch.float32))
        torch.nn.init.normal_(self.fn, std=config.init_method_std)

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        w = (self.fn, self.base, self.scale)
        pre, post, comb = hc.mixes(streams, *w, self.iters, self.hc_eps, self.norm_eps)
        return post, comb, hc.collapse(pre, streams)


mix = hc.mix
"""The streams after a block (miles/engine/hyper_connections.py)."""


class HyperHead(MegatronModule):
    """The last collapse of the streams, before the final norm."""

    def __init__(self, config: Any, hc_mult: int, hc_eps: float, norm_eps: float) -> None:
        super().__init__(config=config)
        self.hc_eps, self.norm_eps = hc_eps, norm_eps
        self.hc_fn = torch.nn.Parameter(
            torch.empty(hc_mult, hc_mult * config.hidden_size, dtype=torch.float32)
        )
        self.hc_base = torch.nn.Parameter(torch.zeros(hc_mult, dtype=torch.float32))
        self.hc_scale = torch.nn.Parameter(torch.ones(1, dtype=torch.float32))
        torch.nn.init.normal_(self.hc_fn, std=config.init_method_std)

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        w = (self.hc_fn, self.hc_base, self.hc_scale)
        return hc.collapse(hc.head_weights(streams, *w, self.hc_eps, self.norm_eps), streams)
