"""Pure-torch MoE: routing and the expert MLPs. The CPU path, and the twin of the GPU MoE kernels."""

from __future__ import annotations

import torch
from torch import nn


def route(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k experts per token, then a softmax over the k chosen logits (not over all experts).

    The weights are computed in fp32: Perplexity found bf16-or-better expert weights essential."""
    values, ids = torch.topk(router_logits.float(), top_k, dim=-1, sorted=True)  # [T, k]
    return ids, torch.softmax(values, dim=-1)


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    # GPT-OSS quirks: gate/up interleaved (even/odd rows), gate clamped only from above, up clamped
    # both ways and shifted by +1.
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return gate * torch.sigmoid(alpha * gate) * (up + 1)


class TorchExperts(nn.Module):
    """Experts [first_expert, first_expert + num_local) of a layer, weights in nn.Linear layout (out, in).

    `forward` returns this shard's contribution: the routing-weighted sum over the local experts only;
    expert parallelism sums the shards with an all-reduce."""

    def __init__(self, num_local: int, first_expert: int, hidden: int, intermediate: int,
                 alpha: float, limit: float, dtype: torch.dtype, device=None):
        super().__init__()
        self.first_expert = first_expert
        self.num_local = num_local
        self.alpha, self.limit = alpha, limit
        kw = dict(dtype=dtype, device=device)
        self.gate_up_proj = nn.Parameter(torch.empty(num_local, 2 * intermediate, hidden, **kw), requires_grad=False)
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_local, 2 * intermediate, **kw), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_local, hidden, intermediate, **kw), requires_grad=False)
        self.down_proj_bias = nn.Parameter(torch.empty(num_local, hidden, **kw), requires_grad=False)

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor) -> torch.Tensor:
        # x [T, D], expert_ids / expert_weights [T, k]
        out = torch.zeros(x.shape[0], self.down_proj.shape[1], dtype=torch.float32, device=x.device)
        local_ids = expert_ids - self.first_expert
        for e in torch.unique(local_ids).tolist():
            if not 0 <= e < self.num_local:
                continue
            token, slot = torch.nonzero(local_ids == e, as_tuple=True)
            h = x[token] @ self.gate_up_proj[e].T + self.gate_up_proj_bias[e]
            h = clamped_swiglu(h, self.alpha, self.limit)
            y = h @ self.down_proj[e].T + self.down_proj_bias[e]
            out.index_add_(0, token, y.float() * expert_weights[token, slot, None])
        return out.to(x.dtype)
