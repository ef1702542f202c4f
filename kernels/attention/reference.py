"""Pure-torch sink attention: the CPU path of the product and the twin of every GPU attention kernel."""

from __future__ import annotations

import torch


def sink_attention(
    q: torch.Tensor,  # [n, Hq, D] new queries, the last n positions of the visible KV
    k: torch.Tensor,  # [L, Hkv, D] visible keys (L >= n)
    v: torch.Tensor,  # [L, Hkv, D]
    sinks: torch.Tensor,  # [Hq] learned logit per head, joins the softmax unscaled
    scale: float,
    window: int | None,  # a query sees itself and window - 1 keys before it; None: full causal
) -> torch.Tensor:  # [n, Hq, D] in q's dtype, computed in fp32
    n, hq, d = q.shape
    kv_len, hkv, _ = k.shape
    group = hq // hkv
    qf = q.float().view(n, hkv, group, d)
    scores = torch.einsum("nhgd,lhd->hgnl", qf, k.float()) * scale  # [Hkv, G, n, L]
    q_pos = torch.arange(kv_len - n, kv_len, device=q.device)[:, None]
    k_pos = torch.arange(kv_len, device=q.device)[None, :]
    visible = k_pos <= q_pos
    if window is not None:
        visible &= q_pos - k_pos < window
    scores = scores.masked_fill(~visible, float("-inf"))
    sink = sinks.float().view(hkv, group, 1, 1).expand(hkv, group, n, 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    out = torch.einsum("hgnl,lhd->nhgd", probs, v.float())
    return out.reshape(n, hq, d).to(q.dtype)


def gather_pages(cache: torch.Tensor, pages: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` tokens stored in `pages` of a paged cache [num_blocks, block_size, H, D]."""
    return cache[pages].flatten(0, 1)[:length]


def sliding_tile_lists(query_lens: list[int], block_m: int, q_starts: list[int] | None = None):
    """The twin of sliding_prefill_triton.plan_tiles, by a plain loop over the tiles: (sequence of each tile,
    its first query, each sequence's first row in q, its query count)."""
    seq_of_tile, q0_of_tile, starts, row = [], [], [], 0
    for b, n in enumerate(query_lens):
        starts.append(row if q_starts is None else q_starts[b])
        row += n
        for q0 in range(0, n, block_m):
            seq_of_tile.append(b)
            q0_of_tile.append(q0)
    return seq_of_tile, q0_of_tile, starts, list(query_lens)
