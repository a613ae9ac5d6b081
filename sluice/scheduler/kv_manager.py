"""Who owns which KV slot: request slots, token slots and the radix cache, kept consistent.

Every token slot is in exactly one of three places: free in the allocator, held by the
radix cache (locked by running requests or evictable), or owned by one running request
(the part of its sequence the cache does not hold yet).
"""

from __future__ import annotations

import torch

from sluice.scheduler.memory_pool import ReqToTokenPool, TokenToKVSlotAllocator
from sluice.scheduler.radix_cache import RadixCache
from sluice.scheduler.req import Req


class KVManager:
    def __init__(self, max_total_tokens: int, max_running_requests: int, context_len: int, disable_radix_cache: bool):
        self.allocator = TokenToKVSlotAllocator(max_total_tokens)
        # A few spare request slots: retracted and chunked requests hold theirs briefly.
        self.req_to_token_pool = ReqToTokenPool(max_running_requests + 8, context_len + 1)
        self.tree_cache = RadixCache(self.allocator, disabled=disable_radix_cache)

    @property
    def req_to_token(self) -> torch.Tensor:
        return self.req_to_token_pool.req_to_token

    # ------------------------------------------------------------ figures

    @property
    def total(self) -> int:
        return self.allocator.total

    def free(self) -> int:
        return self.allocator.available()

    def cached(self) -> int:
        return self.tree_cache.total_size()

    def available(self) -> int:
        """Slots a new allocation can get: free ones and evictable cached ones."""
        return self.allocator.available() + self.tree_cache.evictable_size()

    def in_use(self) -> int:
        """Slots owned by requests or locked for them in the cache."""
        return self.total - self.free() - self.tree_cache.evictable_size()

    # ------------------------------------------------------------ request life

    def cached_prefix_len(self, req: Req) -> int:
        """Length of the cached prefix a new (or resumed) request could reuse; changes nothing."""
        return self.tree_cache.cached_prefix_len(self._prefix_key(req))

    def admit(self, req: Req) -> bool:
        """Give a waiting request a request slot and lock its cached prefix."""
        slot = self.req_to_token_pool.alloc()
        if slot is None:
            return False
        match = self.tree_cache.match_prefix(self._prefix_key(req))
        prefix_len = len(match.slots)
        self.req_to_token[slot, :prefix_len] = match.slots
        self.tree_cache.inc_lock_ref(match.last_node)
        req.req_pool_idx = slot
        req.kv_len = prefix_len
        req.locked_prefix_len = prefix_len
        req.last_node = match.last_node
        if req.times_retracted == 0:
            req.cached_tokens = prefix_len
        return True

    def alloc_tokens(self, num_tokens: int) -> torch.Tensor | None:
        """Token slots, evicting unlocked cache leaves if needed; None if there are too few."""
        if self.allocator.available() < num_tokens:
            self.tree_cache.evict(num_tokens - self.allocator.available())
        return self.allocator.alloc(num_tokens)

    def cache_prefix(self, req: Req) -> None:
        """Hand the KV a running request has computed so far to the radix cache."""
        slots = req.kv_slots(self.req_to_token)
        new_node, new_prefix_len = self.tree_cache.cache_sequence(
            req.fill_slice(0, req.kv_len), slots, req.last_node, req.locked_prefix_len
        )
        # The cache may already have held part of this range: it keeps its own slots,
        # which the request now points at.
        matched = self.tree_cache.match_prefix(req.fill_slice(0, new_prefix_len))
        self.req_to_token[req.req_pool_idx, :new_prefix_len] = matched.slots
        req.last_node = new_node
        req.locked_prefix_len = new_prefix_len

    def release(self, req: Req, keep_in_cache: bool) -> None:
        """Free a request's slots: into the cache (finished) or back to the allocator."""
        if req.req_pool_idx is None:
            return
        slots = req.kv_slots(self.req_to_token)
        if keep_in_cache:
            self.tree_cache.cache_sequence(
                req.fill_slice(0, req.kv_len), slots, req.last_node, req.locked_prefix_len, keep_lock=False
            )
        else:
            owned = slots[req.locked_prefix_len :]
            if len(owned):
                self.allocator.free(owned.clone())
            self.tree_cache.dec_lock_ref(req.last_node)
        self.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx = None
        req.kv_len = 0
        req.locked_prefix_len = 0
        req.last_node = None

    def flush(self) -> bool:
        """Drop the whole cache; only when no request holds any of it."""
        if self.in_use() > 0:
            return False
        self.tree_cache.reset()
        return True

    def check_integrity(self, owned_by_requests: int) -> None:
        self.tree_cache.check_integrity()
        counted = self.allocator.available() + self.tree_cache.total_size() + owned_by_requests
        assert counted == self.total, f"KV slots leaked: free+cached+owned={counted} != total={self.total}"

    @staticmethod
    def _prefix_key(req: Req) -> list[int]:
        # At least one token must be computed to get logits for the next one. A request
        # that wants prompt logprobs from position s needs the logits at s - 1.
        limit = 0 if req.needs_every_position else req.seq_len - 1
        if req.wants_input_logprobs:
            limit = min(limit, max(req.logprob_start_len - 1, 0))
        return req.fill_slice(0, limit)
