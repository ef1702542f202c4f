"""Moving a prefilled request's K/V (engine/kv_payload.py's PrefilledKV) from a prefill to a decode replica.

One interface, two transports, and a three-message protocol that fits Serve's request/response calls:

1. decode: `offer = transport.offer(max_bytes)` says how it wants to receive (sent with the prompt);
2. prefill: `handle = transport.send(payload, offer)` ships the K/V and returns a small, picklable handle
   (sent back with the first token);
3. decode: `payload = await transport.receive(handle, offer, timeout_s)`, then `transport.release(offer)`;
   a prefill call that was given up on (timeout) releases its offer only when it finally ends, since
   until then the prefill replica may still write into the offered slot.

Every transport packs the payload's K/V tensors into one flat byte buffer (one allocation, one copy, one
handle), so per-transfer overhead does not grow with the number of layers.

- `ObjectStoreTransport` (`object_store`): the buffer goes into Ray's object store on the prefill node and
  the decode replica reads it (zero-copy on the same node, over the network otherwise). Works everywhere,
  CPU included; the default on CPU and in CI.
- `CudaIpcTransport` (`cuda_ipc`): GPU to GPU inside one node. The decode replica owns a receive arena in
  GPU memory and shares its CUDA IPC handle (torch.multiprocessing's reductions around cudaIpcGetMemHandle)
  in the offer; the prefill replica maps the arena once per peer and copies the K/V straight into the slot
  reserved for this request (device-to-device, over NVLink when the GPUs differ). The decode side owns the
  slot's lifetime, so nothing leaks when a prefill replica dies or a request is abandoned: the slot is
  freed when the prefill call ends. Peers on another node, or an arena without room, fall back to the
  object store for that transfer.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
import threading
import time
import uuid
import warnings
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any

import torch

from engine.kv_payload import KVDestination, PrefilledKV

log = logging.getLogger(__name__)

ALIGN = 256  # byte alignment of each tensor in the flat buffer (covers every dtype and vector loads)
TRANSPORTS = ("object_store", "cuda_ipc")


class KVTransferError(RuntimeError):
    """A transfer failed or timed out; the decode replica runs the prompt itself instead."""


# ---- packing: K/V tensors <-> one flat byte buffer ------------------------------------------------------
@dataclass(frozen=True)
class TensorSpec:
    offset: int  # bytes from the start of the buffer
    dtype: str  # torch dtype name, e.g. "bfloat16"
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = getattr(torch, self.dtype).itemsize
        for d in self.shape:
            n *= d
        return n


def plan_layout(tensors: list[torch.Tensor]) -> tuple[list[TensorSpec], int]:
    return plan_shapes([(tuple(t.shape), t.dtype) for t in tensors])


def plan_shapes(shapes: list[tuple[tuple[int, ...], torch.dtype]]) -> tuple[list[TensorSpec], int]:
    """Each tensor's place in the flat buffer (ALIGN-aligned, in order) and the buffer's size."""
    specs, offset = [], 0
    for shape, dtype in shapes:
        spec = TensorSpec(offset, str(dtype).removeprefix("torch."), tuple(shape))
        specs.append(spec)
        offset += -(-spec.nbytes // ALIGN) * ALIGN
    return specs, offset


def pack_into(flat: torch.Tensor, tensors: list[torch.Tensor], specs: list[TensorSpec]) -> None:
    """Copy each tensor into its place in `flat` (uint8, any device; cross-device copies allowed)."""
    for t, spec in zip(tensors, specs):
        unpack_one(flat, spec).copy_(t, non_blocking=True)


def unpack_one(flat: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    return flat[spec.offset: spec.offset + spec.nbytes].view(getattr(torch, spec.dtype)).view(spec.shape)


def unpack(flat: torch.Tensor, specs: list[TensorSpec]) -> list[torch.Tensor]:
    return [unpack_one(flat, s) for s in specs]


def split_payload(payload: PrefilledKV) -> tuple[PrefilledKV, list[torch.Tensor]]:
    """(the payload without tensors, its tensors: K of every layer, then V of every layer)."""
    return replace(payload, k=[], v=[]), [*payload.k, *payload.v]


def join_payload(skeleton: PrefilledKV, tensors: list[torch.Tensor]) -> PrefilledKV:
    n = len(tensors) // 2
    return replace(skeleton, k=tensors[:n], v=tensors[n:])


def payload_upper_bound(num_prompt_tokens: int, num_layers: int, sliding: list[bool], window: int,
                        kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes the packed K/V of a just-prefilled prompt can take: full layers hold every prompt token,
    sliding layers at most the window."""
    elt = dtype.itemsize
    rows = [min(num_prompt_tokens, window) if s else num_prompt_tokens for s in sliding[:num_layers]]
    per_row = kv_heads * head_dim * elt
    return sum(2 * (-(-r * per_row // ALIGN) * ALIGN) for r in rows)


# ---- the protocol messages ------------------------------------------------------------------------------
@dataclass
class ReceiveOffer:
    """How a decode replica wants one request's K/V (travels with the prompt to the prefill replica)."""

    kind: str  # "object_store" | "cuda_ipc"
    node_id: str
    gpu_uuid: str | None = None
    arena_key: str | None = None  # stable per decode replica: the prefill side maps each arena once
    arena_ipc: tuple | None = None  # torch's rebuild_cuda_tensor arguments of the arena
    slot_offset: int = 0
    slot_nbytes: int = 0


@dataclass
class KVHandle:
    """How the K/V was shipped (travels with the first token back to the decode replica)."""

    kind: str  # the transport actually used; cuda_ipc offers can be answered through the object store
    skeleton: PrefilledKV  # the payload without its tensors
    specs: list[TensorSpec]
    nbytes: int
    pack_ms: float
    ref: Any = None  # object_store: the ObjectRef of the flat buffer (owned by the prefill replica)
    node_id: str = ""  # the prefill replica's node (set by PrefillServer)


@dataclass
class TransferStats:
    kind: str
    nbytes: int
    pack_ms: float  # on the prefill replica
    receive_ms: float  # on the decode replica: from the handle's arrival to tensors ready
    wait_ms: float | None = None  # of receive_ms, waiting for the copy out of the slot (CUDA IPC)


@functools.cache
def _ray():
    """Ray, or None in a process without it (the CUDA IPC test on a bare GPU host). Cached: a failed
    import is retried on every call otherwise, ~0.5 ms on the hand-off's path."""
    try:
        import ray
    except ImportError:
        return None
    return ray


def current_node_id() -> str:
    ray = _ray()
    if ray is not None and ray.is_initialized():
        return ray.get_runtime_context().get_node_id()
    return socket.gethostname()


# ---- transports ------------------------------------------------------------------------------------------
class ObjectStoreTransport:
    """K/V through Ray's object store: host memory on the prefill node, fetched by the decode replica."""

    name = "object_store"

    def __init__(self, device: str = "cpu"):
        self.device = torch.device(device)
        self.last_stats: TransferStats | None = None

    def offer(self, max_bytes: int) -> ReceiveOffer:
        return ReceiveOffer("object_store", current_node_id())

    def export_target(self, offer: ReceiveOffer) -> KVDestination | None:
        """Where the engine may export K/V for this offer: anywhere (the payload is packed by `send`)."""
        return None

    def send(self, payload: PrefilledKV, offer: ReceiveOffer) -> KVHandle:
        import ray

        t0 = time.perf_counter()
        skeleton, tensors = split_payload(payload)
        specs, total = plan_layout(tensors)
        on_gpu = any(t.is_cuda for t in tensors)
        flat = torch.empty(total, dtype=torch.uint8, pin_memory=on_gpu)
        pack_into(flat, tensors, specs)
        if on_gpu:
            torch.cuda.synchronize()
        ref = ray.put(flat.numpy())
        return KVHandle("object_store", skeleton, specs, total, (time.perf_counter() - t0) * 1e3, ref)

    async def receive(self, handle: KVHandle, offer: ReceiveOffer, timeout_s: float) -> PrefilledKV:
        if handle.kind != "object_store":
            raise KVTransferError(f"{self.name} transport got a {handle.kind!r} handle: prefill and decode "
                                  "must be configured with the same kv_transport")
        import ray

        t0 = time.perf_counter()
        try:
            array = await asyncio.wait_for(handle.ref, timeout_s)
        except asyncio.TimeoutError:
            raise KVTransferError(f"K/V of {handle.skeleton.request_id} ({handle.nbytes} bytes) did not "
                                  f"arrive within {timeout_s} s") from None
        except ray.exceptions.RayError as err:  # owner died, object lost, ...
            raise KVTransferError(f"K/V of {handle.skeleton.request_id} is unreachable: {err}") from err
        with warnings.catch_warnings():
            # The object store hands out a read-only buffer; the engine only reads it (copies it into
            # its pages), and the tensor keeps the buffer pinned until then.
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            flat = torch.from_numpy(array)
        if self.device.type != "cpu":
            flat = flat.to(self.device)
        payload = join_payload(handle.skeleton, unpack(flat, handle.specs))
        self.last_stats = TransferStats(handle.kind, handle.nbytes, handle.pack_ms,
                                        (time.perf_counter() - t0) * 1e3)
        return payload

    def release(self, offer: ReceiveOffer) -> None:
        """Nothing to free: the object is dropped when the last reference to the handle goes."""


class _Arena:
    """First-fit allocator over one GPU buffer, in ALIGN-sized units."""

    def __init__(self, nbytes: int, device: torch.device):
        self.buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self._free: list[tuple[int, int]] = [(0, nbytes)]  # (offset, size), sorted, coalesced

    def allocate(self, nbytes: int) -> int | None:
        nbytes = -(-nbytes // ALIGN) * ALIGN
        for i, (offset, size) in enumerate(self._free):
            if size >= nbytes:
                if size == nbytes:
                    del self._free[i]
                else:
                    self._free[i] = (offset + nbytes, size - nbytes)
                return offset
        return None

    def free(self, offset: int, nbytes: int) -> None:
        nbytes = -(-nbytes // ALIGN) * ALIGN
        self._free.append((offset, nbytes))
        self._free.sort()
        merged: list[tuple[int, int]] = []
        for off, size in self._free:
            if merged and merged[-1][0] + merged[-1][1] == off:
                merged[-1] = (merged[-1][0], merged[-1][1] + size)
            else:
                merged.append((off, size))
        self._free = merged

    @property
    def free_bytes(self) -> int:
        return sum(size for _, size in self._free)


class CudaIpcTransport(ObjectStoreTransport):
    """GPU-to-GPU K/V within a node through a CUDA IPC-shared receive arena on the decode replica."""

    name = "cuda_ipc"
    # Where export_target has the engine gather the K/V: "peer", straight into the decode replica's slot
    # (the gather kernel's stores cross NVLink); "local", into one buffer on this GPU laid out as the slot,
    # which send() then copies across in one copy-engine transfer. Gather + send on 2x H200 (2026-11-30,
    # `python -m bench.kv_transfer --send-modes export_peer,export_local`, 120b shapes): 1.25 / 1.94 /
    # 5.39 ms (peer) against 1.34 / 2.05 / 5.80 ms (local) for 40.5 / 292.5 / 1,156.5 MiB.
    export_via = "peer"

    def __init__(self, device: str, arena_bytes: int, max_peers: int = 16):
        super().__init__(device)
        if self.device.type != "cuda":
            raise KVTransferError(f"cuda_ipc needs a CUDA device, got {device!r}: use kv_transport=object_store")
        self.arena_bytes = arena_bytes
        self._arena: _Arena | None = None  # receiving side, allocated on first offer
        self._copy_stream = None  # receiving side: where slots are copied out (receive)
        self._arena_key = uuid.uuid4().hex
        self._arena_ipc: tuple | None = None
        self._peers: OrderedDict[str, torch.Tensor] = OrderedDict()  # sending side: mapped arenas, LRU
        self._max_peers = max_peers
        # The engine thread maps arenas (export_target) while the event loop does too (send)
        self._peers_lock = threading.Lock()

    # -- decode side
    def reserve_arena(self) -> None:
        """Allocate the receive arena now (before the engine sizes its KV pools from free memory)."""
        if self._arena is None:
            from torch.multiprocessing.reductions import reduce_tensor

            self._arena = _Arena(self.arena_bytes, self.device)
            _, self._arena_ipc = reduce_tensor(self._arena.buffer)

    def offer(self, max_bytes: int) -> ReceiveOffer:
        self.reserve_arena()
        offset = self._arena.allocate(max_bytes)
        if offset is None:  # arena full (many transfers in flight) or one huge prompt
            return super().offer(max_bytes)
        return ReceiveOffer("cuda_ipc", current_node_id(), _gpu_uuid(self.device), self._arena_key, self._arena_ipc,
                            offset, max_bytes)

    async def receive(self, handle: KVHandle, offer: ReceiveOffer, timeout_s: float) -> PrefilledKV:
        if handle.kind == "object_store":
            return await super().receive(handle, offer, timeout_s)
        if handle.kind != "cuda_ipc" or offer.kind != "cuda_ipc" or handle.nbytes > offer.slot_nbytes:
            raise KVTransferError(f"handle {handle.kind!r} ({handle.nbytes} bytes) does not match the offer "
                                  f"{offer.kind!r} ({offer.slot_nbytes} bytes)")
        t0 = time.perf_counter()
        # The sender synchronized before answering, so the slot is complete. Copy it out, because the
        # engine writes K/V into its pages only when it next schedules the request, and wait for the
        # copy: once `release` frees the slot another prefill process may write into it, and nothing
        # orders its writes after our copy. The copy runs on a stream of its own: on the engine's stream
        # it queued behind the decode steps in flight, and waiting for it took 5-95 ms on 2x H200 under
        # load (2026-11-30, bench.serve_load, 20b, 2k-token prompts; 0.04-0.06 ms when decode was idle).
        slot = self._arena.buffer[offer.slot_offset: offer.slot_offset + handle.nbytes]
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(device=self.device)
        with torch.cuda.stream(self._copy_stream):
            flat = slot.clone()
        # The engine reads `flat` on its own (the device's default) stream; the allocator must not hand
        # the block to the next copy before that read has run.
        flat.record_stream(torch.cuda.default_stream(self.device))
        t1 = time.perf_counter()
        self._copy_stream.synchronize()
        t2 = time.perf_counter()
        payload = join_payload(handle.skeleton, unpack(flat, handle.specs))
        self.last_stats = TransferStats(handle.kind, handle.nbytes, handle.pack_ms, (time.perf_counter() - t0) * 1e3,
                                        (t2 - t1) * 1e3)
        return payload

    def release(self, offer: ReceiveOffer) -> None:
        if offer.kind == "cuda_ipc" and offer.arena_key == self._arena_key:
            self._arena.free(offer.slot_offset, offer.slot_nbytes)

    @property
    def arena_free_bytes(self) -> int | None:
        return None if self._arena is None else self._arena.free_bytes

    # -- prefill side
    def export_target(self, offer: ReceiveOffer) -> KVDestination | None:
        """Where the prefill engine can gather a request's K/V straight into the offered slot (the layout
        `send` would pack), so that `send` has nothing left to copy; None when this offer cannot take it."""
        if offer.kind != "cuda_ipc":
            return None

        def into(shapes: list[tuple[int, ...]], dtype: torch.dtype) -> list[torch.Tensor] | None:
            peer = self._map_peer(offer)
            specs, total = plan_shapes([(shape, dtype) for shape in shapes])
            if peer is None or peer.device != self.device or total > offer.slot_nbytes:
                return None  # send() then copies (or falls back) as usual
            if self.export_via == "local":
                return unpack(torch.empty(total, dtype=torch.uint8, device=self.device), specs)
            return unpack(peer[offer.slot_offset: offer.slot_offset + total], specs)

        return into

    def send(self, payload: PrefilledKV, offer: ReceiveOffer) -> KVHandle:
        peer = self._map_peer(offer) if offer.kind == "cuda_ipc" else None
        if peer is None or not all(t.is_cuda for t in (*payload.k, *payload.v)):
            return super().send(payload, offer)
        t0 = time.perf_counter()
        skeleton, tensors = split_payload(payload)
        specs, total = plan_layout(tensors)
        if total > offer.slot_nbytes:
            log.warning("K/V of %s needs %d bytes, the decode slot has %d: sending through the object store",
                        payload.request_id, total, offer.slot_nbytes)
            return super().send(payload, offer)
        slot = peer[offer.slot_offset: offer.slot_offset + total]
        packed = _packed_flat(tensors, specs, total)  # laid out as the slot wants (export_target)?
        if packed is not None and packed.data_ptr() == slot.data_ptr():
            pass  # exported into the slot itself
        elif packed is not None:
            slot.copy_(packed, non_blocking=True)  # one copy across
        else:  # each tensor straight into the slot (packing on this GPU first and crossing in one copy measured
            # slower: 292.5 MiB in 3.31 against 1.98 ms on 2x H200, 2026-11-30, bench/results/kv_transfer_h200x2_modes_*)
            pack_into(slot, tensors, specs)
        # The decode replica reads the slot right after our answer: every copy must have landed.
        torch.cuda.synchronize(self.device)
        torch.cuda.synchronize(slot.device)
        return KVHandle("cuda_ipc", skeleton, specs, total, (time.perf_counter() - t0) * 1e3)

    def _map_peer(self, offer: ReceiveOffer) -> torch.Tensor | None:
        """The decode replica's arena mapped into this process, or None when it is out of reach."""
        if offer.node_id != current_node_id():
            return None
        with self._peers_lock:
            return self._map_peer_locked(offer)

    def _map_peer_locked(self, offer: ReceiveOffer) -> torch.Tensor | None:
        if offer.arena_key in self._peers:
            self._peers.move_to_end(offer.arena_key)
            return self._peers[offer.arena_key]
        local = _local_index_of(offer.gpu_uuid)
        if local is None:
            log.warning("decode GPU %s is not visible here (CUDA_VISIBLE_DEVICES?); K/V goes through the "
                        "object store", offer.gpu_uuid)
            return None
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        # Opened in this GPU's context, the arena is a peer mapping that this GPU's copies (and kernels)
        # write over NVLink: 300-380 GB/s on 2x H200 (bench/kv_transfer.py). Opened in the decode GPU's
        # context instead, copies from here into it were staged by the driver at 10-35 GB/s. Without peer
        # access between the two GPUs only the latter works.
        own = self.device.index if self.device.index is not None else torch.cuda.current_device()
        contexts = [own, local] if own != local and torch.cuda.can_device_access_peer(own, local) else [local]
        arena, errors = None, []
        for storage_device in contexts:
            args = list(offer.arena_ipc)
            args[6] = storage_device  # the GPU (as numbered in this process) whose context maps the arena
            try:
                arena = rebuild_cuda_tensor(*args)
                break
            except RuntimeError as err:  # e.g. IPC unsupported between these processes
                errors.append(f"on cuda:{storage_device}: {err}")
        if arena is None:
            log.warning("cannot map decode arena %s over CUDA IPC (%s); using the object store",
                        offer.arena_key, "; ".join(errors))
            return None
        self._peers[offer.arena_key] = arena
        while len(self._peers) > self._max_peers:
            self._peers.popitem(last=False)  # a replaced decode replica: unmap its arena
        return arena


def _packed_flat(tensors: list[torch.Tensor], specs: list[TensorSpec], total: int) -> torch.Tensor | None:
    """The `total`-byte buffer the tensors sit in at their specs' offsets (views of one allocation, as
    export_target hands out), or None when they are laid out otherwise."""
    if not tensors:
        return None
    storage = tensors[0].untyped_storage()
    base = tensors[0].data_ptr() - specs[0].offset
    start = base - storage.data_ptr()
    if start < 0 or start + total > storage.nbytes() or not all(
            t.untyped_storage().data_ptr() == storage.data_ptr() and t.data_ptr() == base + spec.offset
            and t.is_contiguous() for t, spec in zip(tensors, specs)):
        return None
    return torch.empty(0, dtype=torch.uint8, device=tensors[0].device).set_(storage, start, (total,))


def _gpu_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def _local_index_of(gpu_uuid: str | None) -> int | None:
    if gpu_uuid is None:
        return None
    for i in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(i).uuid) == gpu_uuid:
            return i
    return None


def make_transport(name: str, device: str, cuda_ipc_arena_bytes: int = 0) -> ObjectStoreTransport:
    if name == "object_store":
        return ObjectStoreTransport(device)
    if name == "cuda_ipc":
        return CudaIpcTransport(device, cuda_ipc_arena_bytes)
    raise KVTransferError(f"unknown kv_transport {name!r}; choose one of {TRANSPORTS}")
