"""What a prefill engine hands to a decode engine: K/V by token (not by page) plus the sampling state.

Pages are a local allocation detail, so the payload carries per-layer K/V of exactly the tokens the
decode side needs: every token for full layers, and only the last window - 1 for sliding layers (the
next query sees itself plus window - 1 earlier keys; older ones are never read again). Tensors are
plain torch tensors on the prefill device; a transport (Ray object store, NIXL, ...) moves them as is.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.request import TokenLogprob


# Where an export may write its K/V: given the per-tensor shapes (every layer's K, then every V) and the
# dtype, the destination tensors (e.g. views of a transport's receive slot on another GPU), or None for
# new ones. Lets the prefill side gather pages straight into the decode replica's slot.
KVDestination = Callable[[list[tuple[int, ...]], torch.dtype], "list[torch.Tensor] | None"]


class KVPayloadError(ValueError):
    """A payload that does not fit this engine's model (layers, heads, lengths); says which part."""


@dataclass
class PrefilledKV:
    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]  # tokens sampled so far (after a prefill: the first token)
    output_logprobs: list[TokenLogprob]
    seed: int  # with step = len(output_ids), the sampler state: decode continues the same noise stream
    num_cached: int  # K/V covers positions 0 .. num_cached - 1 (everything but the last sampled token)
    sliding_start: int  # first position held by sliding layers
    layer_is_sliding: list[bool]
    k: list[torch.Tensor]  # per layer [tokens, Hkv, Dh]: num_cached rows (full) or num_cached - sliding_start
    v: list[torch.Tensor]
    num_cached_tokens: int = 0  # prompt tokens the prefill engine took from its prefix cache (usage reports)

    def __getstate__(self) -> dict:
        # float8 tensors do not survive pickling in torch 2.13 (the storage loses its dtype): K/V from an
        # fp8 cache travel as bytes and are viewed back on arrival
        state = dict(self.__dict__)
        for name in ("k", "v"):
            state[name] = [(t.view(torch.uint8), str(t.dtype)) if t.element_size() == 1 and t.is_floating_point()
                           else t for t in state[name]]
        return state

    def __setstate__(self, state: dict) -> None:
        for name in ("k", "v"):
            state[name] = [t[0].view(getattr(torch, t[1].removeprefix("torch."))) if isinstance(t, tuple) else t
                           for t in state[name]]
        state.setdefault("num_cached_tokens", 0)  # payloads pickled before the field existed
        self.__dict__.update(state)

    @property
    def step(self) -> int:
        return len(self.output_ids)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    def check_compatible(self, layer_is_sliding: list[bool], kv_heads: int, head_dim: int) -> None:
        if self.layer_is_sliding != layer_is_sliding:
            raise KVPayloadError(f"payload for {self.request_id} has layer kinds {self.layer_is_sliding}, "
                                 f"this model {layer_is_sliding}: prefill and decode must load the same model")
        if self.num_cached != len(self.prompt_ids) + len(self.output_ids) - 1 or not self.output_ids:
            raise KVPayloadError(f"payload for {self.request_id}: num_cached={self.num_cached} must equal "
                                 f"prompt + output tokens - 1 with at least one output token")
        if not len(self.k) == len(self.v) == len(layer_is_sliding):
            raise KVPayloadError(f"payload for {self.request_id} has {len(self.k)} K and {len(self.v)} V tensors; "
                                 f"this model has {len(layer_is_sliding)} layers")
        for layer, (k, v, sliding) in enumerate(zip(self.k, self.v, layer_is_sliding)):
            rows = self.num_cached - (self.sliding_start if sliding else 0)
            want = (rows, kv_heads, head_dim)
            if tuple(k.shape) != want or tuple(v.shape) != want:
                raise KVPayloadError(f"payload for {self.request_id}: layer {layer} K/V shapes {tuple(k.shape)}, "
                                     f"{tuple(v.shape)}; this engine needs {want} (same TP size on both sides?)")
