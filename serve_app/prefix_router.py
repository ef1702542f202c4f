"""Prefix-affinity request routing: a prompt that starts like one a replica ran lately goes to that replica,
whose engine still holds the K/V of the shared prefix (enable_prefix_caching), unless it is busier.

Ray Serve routes each handle call through a RequestRouter living in the caller's process: the decode
replica's handle to the prefill deployment (disaggregated), or the ingress's handle to the decode
deployment (prefill on decode). `PrefixAffinityRouter` replaces the default power-of-two-choices there:

- the prompt (the GenerateRequest among the call's arguments) is cut into blocks of `block_tokens` and
  chained into hashes as the prefix cache names its blocks (engine/block_manager.prefix_block_hashes:
  block i's hash covers tokens 0 .. (i+1) * block_tokens): equal hashes mean an equal prefix of that length;
- `PrefixTable` remembers, for the last `max_entries` block hashes, which replicas served a prompt with
  that prefix; a new prompt's deepest remembered block names the replicas holding most of it;
- those replicas are tried first when their known queue is at most `imbalance` requests longer than the
  shortest known queue, else two random replicas (as the default router does); Serve then probes the
  first group's queues and sends the request to one that accepts it.

What a miss costs: the prefix is computed again on another replica, which then also holds it (both are
remembered). A shared system prompt therefore ends up cached on every replica while long conversations
stay where their history is. State is per caller process and approximate (an engine may have evicted
pages since); routing never waits on it.

With `same_node` (a decode replica's calls to the prefill deployment, disaggregated): the prompt's K/V comes
back to the caller, over CUDA IPC or the node's shared-memory object store when the prefill replica is on the
caller's node, over the network otherwise, for every token of the prompt and whether or not its prefix was
cached. So replicas on the caller's node come first while one of them is within `imbalance` of the shortest
known queue: the ones among them holding the prefix, else two of them at random; then the other nodes'
holders, then two random replicas. Without a replica near enough on the node, routing is as above.
(Serve's own router prefers the caller's node only for its HTTP proxies, not for calls between deployments.)
"""

from __future__ import annotations

import random
from collections import OrderedDict
from typing import Any

from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

from engine.page_pool import prefix_block_hashes
from engine.request import GenerateRequest

OUTCOMES = {"affinity": "sent first to replicas holding part of the prompt",
            "same_node": "sent first to replicas on the caller's node (same_node), none of them holding the prompt",
            "busy": "the holders' queues were too long: two random replicas",
            "no_match": "no remembered prefix: two random replicas",
            "no_prompt": "a call without a prompt (stats, abort)"}
BLOCK_TOKENS = 64
MAX_BLOCKS = 256  # prefixes up to 16k tokens are told apart; longer ones by their first 16k
MAX_ENTRIES = 200_000  # block hashes remembered (~ tens of MB of Python objects at most)
IMBALANCE = 4


class PrefixTable:
    """Block hash -> the replicas that served a prompt with that prefix (most recent last), LRU-bounded."""

    def __init__(self, max_entries: int = MAX_ENTRIES, replicas_per_entry: int = 4):
        self.max_entries = max_entries
        self.replicas_per_entry = replicas_per_entry
        self._entries: OrderedDict[bytes, list[Any]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, hashes: list[bytes], alive: set) -> tuple[int, list[Any]]:
        """(blocks matched, replicas among `alive` holding that deepest remembered prefix, most recent
        first); (0, []) when no block is remembered on a live replica."""
        for depth in range(len(hashes), 0, -1):
            replicas = self._entries.get(hashes[depth - 1])
            if replicas:
                live = [r for r in reversed(replicas) if r in alive]
                if live:
                    self._entries.move_to_end(hashes[depth - 1])
                    return depth, live
        return 0, []

    def record(self, hashes: list[bytes], replica: Any) -> None:
        for h in hashes:
            replicas = self._entries.pop(h, None) or []
            if replica in replicas:
                replicas.remove(replica)
            replicas.append(replica)
            self._entries[h] = replicas[-self.replicas_per_entry:]
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def forget(self, replica: Any) -> None:
        for h in [h for h, rs in self._entries.items() if replica in rs]:
            rest = [r for r in self._entries[h] if r != replica]
            if rest:
                self._entries[h] = rest
            else:
                del self._entries[h]


def near_holders(holders: list[Any], queues: dict[Any, int | None], imbalance: int) -> list[Any]:
    """The holders (most recent first) whose known queue is at most `imbalance` above the shortest known
    queue among all candidates (`queues`: candidate -> queue length, None when not known yet; unknown
    counts as empty)."""
    known = [q for q in queues.values() if q is not None]
    shortest = min(known) if known else 0
    return [r for r in holders if (queues.get(r) or 0) <= shortest + imbalance]


def first_choices(candidates: list[Any], holders: list[Any], local: set, queues: dict[Any, int | None],
                  imbalance: int, rng: random.Random | Any = random) -> tuple[str, list[list[Any]]]:
    """The routing decision, by outcome (OUTCOMES) and ranked groups of candidates (Serve tries a group's replicas
    by their queues, then the next group). `holders`: candidates holding the prompt's deepest remembered prefix,
    most recent first; `local`: the candidates on the caller's node when same_node routing applies, else empty;
    `queues`: candidate -> known queue length (None: unknown)."""
    others = rng.sample(candidates, min(2, len(candidates)))
    near = near_holders(holders, queues, imbalance)
    near_local = near_holders([r for r in candidates if r in local], queues, imbalance)
    if near_local:
        here = [r for r in near if r in local]
        first = here[:2] if here else rng.sample(near_local, min(2, len(near_local)))
        there = [r for r in near if r not in local][:2]
        groups = [first] + ([there] if there else []) + [[r for r in others if r not in first + there]]
        return ("affinity" if here else "same_node"), [g for g in groups if g]
    if not holders:
        return "no_match", [others]
    if not near:
        return "busy", [others]
    rest = [r for r in others if r not in near[:2]]
    return "affinity", [near[:2], rest] if rest else [near[:2]]


def request_of(pending: PendingRequest | None) -> GenerateRequest | None:
    """The GenerateRequest of a routed call (DecodeServer.generate(request), PrefillServer.prefill(request,
    offer)), or None for calls without one (stats, abort)."""
    if pending is None:
        return None
    for arg in list(pending.args) + list(pending.kwargs.values()):
        if isinstance(arg, GenerateRequest):
            return arg
    return None


class PrefixAffinityRouter(FIFOMixin, RequestRouter):
    """Serve request router: prefix affinity under a load guard, the caller's node first with `same_node`, else
    power of two choices (module doc)."""

    def initialize_state(self, block_tokens: int = BLOCK_TOKENS, max_entries: int = MAX_ENTRIES,
                         imbalance: int = IMBALANCE, prefix_affinity: bool = True, same_node: bool = False,
                         across_nodes_only: bool = False, **kwargs):
        """prefix_affinity: route by remembered prefixes (across_nodes_only: only while the replicas are on more
        than one node); same_node: the caller's node first (module doc)."""
        self.block_tokens = block_tokens
        self.imbalance = imbalance
        self.prefix_affinity = prefix_affinity
        self.across_nodes_only = across_nodes_only
        self.node_id = None  # the caller's node (the router lives in the caller's process)
        if same_node:
            import ray

            self.node_id = ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
        self.table = PrefixTable(max_entries)
        # pending call (by identity: a parent request's calls may share their request ids) -> its block
        # hashes, until routed (bounded: a call cancelled while queued never is)
        self._hashes: OrderedDict[int, list[bytes]] = OrderedDict()
        self.outcomes = {o: 0 for o in OUTCOMES}
        try:  # exported with Serve's metrics (Ray's metrics agent); the router lives in the caller's process
            from ray.util import metrics

            self._counter = metrics.Counter("gptoss_prefix_routing", "Routing decisions of the prefix-affinity "
                                            "router, by outcome: " + "; ".join(f"{k}: {v}" for k, v in OUTCOMES.items()),
                                            tag_keys=("deployment", "outcome"))
            self._counter.set_default_tags({"deployment": self._deployment_id.name})
        except Exception:  # noqa: BLE001  (metrics are optional: no Ray worker context, an older Ray)
            self._counter = None

    def _decided(self, outcome: str) -> None:
        self.outcomes[outcome] += 1
        if self._counter is not None:
            self._counter.inc(1, tags={"outcome": outcome})

    def _queue(self, replica_id: ReplicaID) -> int | None:
        return self.replica_queue_len_cache.get(replica_id)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        request = request_of(pending_request)
        if request is None:
            self._decided("no_prompt")
            return [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]
        by_id = {r.replica_id: r for r in candidate_replicas}
        holders: list[Any] = []
        if self.prefix_affinity and not (self.across_nodes_only and len({r.node_id for r in candidate_replicas}) < 2):
            # (salted as the engines' prefix caches are: a salt's prompts go where that salt's prefix is)
            hashes = prefix_block_hashes(request.prompt_ids, self.block_tokens, MAX_BLOCKS, request.cache_salt)
            self._hashes[id(pending_request)] = hashes
            while len(self._hashes) > 4096:
                self._hashes.popitem(last=False)
            _, holders = self.table.lookup(hashes, set(by_id))
        local = {r.replica_id for r in candidate_replicas if self.node_id and r.node_id == self.node_id}
        if local == set(by_id):  # one node: nothing to prefer
            local = set()
        outcome, groups = first_choices(list(by_id), holders, local, {r: self._queue(r) for r in by_id},
                                        self.imbalance)
        self._decided(outcome)
        return [[by_id[r] for r in group] for group in groups]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any):
        hashes = self._hashes.pop(id(pending_request), None)
        if hashes:
            self.table.record(hashes, replica_id)

    def on_replica_actor_died(self, replica_id: ReplicaID):
        super().on_replica_actor_died(replica_id)
        self.table.forget(replica_id)
