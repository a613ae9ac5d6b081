"""Who owns which KV slot: request slots, token slots and the radix cache, kept consistent.

Every token slot is in exactly one of three places: free in the allocator, held by the
radix cache (locked by running requests or evictable), or owned by one running request
(the part of its sequence the cache does not hold yet).

A model with sliding-window layers keeps their K/V in window slots of their own
(memory_pool.SlidingWindowSlotAllocator). A running request's window always has them; beyond
the windows of running requests, at most `window_cache_tokens` tokens keep theirs, so that
cached prefixes can be continued (least recently used dropped first). A cached prefix is
continued only up to where the window before it is whole.
"""

from __future__ import annotations

import torch

from sluice.scheduler.memory_pool import ReqToTokenPool, SlidingWindowSlotAllocator, TokenToKVSlotAllocator
from sluice.scheduler.radix_cache import RadixCache
from sluice.scheduler.req import Req

# A request takes its token slots in runs of this many consecutive ones (where the free
# slots allow), holding the rest of a run for its next tokens: its K/V rows then lie in
# streams the attention reads at memory speed. One slot per request per step, a 32-request
# decode step's K/V reads interleaved and SmolLM2's attention took 1.3x as long (8.9 against
# 7.0 ms for 30 layers at 200 tokens each; runs of 16: 7.2 ms; 64: 6.8 ms).
SLOT_RUN = 32


class KVManager:
    def __init__(
        self,
        max_total_tokens: int,
        max_running_requests: int,
        context_len: int,
        disable_radix_cache: bool,
        window: int | None = None,
        window_cache_tokens: int = 0,
        window_slots: int | None = None,
    ):
        """window: the sliding-window layers' window (None: the model has none); window_slots:
        how many of their slots there are (at least ServerArgs.window_slots_needed; default as
        many as token slots)."""
        self.allocator = (
            TokenToKVSlotAllocator(max_total_tokens)
            if window is None
            else SlidingWindowSlotAllocator(max_total_tokens, window, window_slots or max_total_tokens)
        )
        self.window_cache_tokens = window_cache_tokens
        # A few spare request slots: retracted and chunked requests hold theirs briefly.
        self.req_to_token_pool = ReqToTokenPool(max_running_requests + 8, context_len + 1)
        self.tree_cache = RadixCache(self.allocator, disabled=disable_radix_cache)

    @property
    def req_to_token(self) -> torch.Tensor:
        return self.req_to_token_pool.req_to_token

    @property
    def windows(self) -> SlidingWindowSlotAllocator | None:
        return self.allocator if isinstance(self.allocator, SlidingWindowSlotAllocator) else None

    @property
    def window_slot_of(self) -> torch.Tensor | None:
        """Each token slot's window slot, for the sliding-window layers (None: no such layers)."""
        windows = self.windows
        return None if windows is None else windows.window_slot_of

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

    def window_slots_held(self) -> int:
        windows = self.windows
        return 0 if windows is None else windows.window_slots_held()

    # ------------------------------------------------------------ request life

    def cached_prefix_len(self, req: Req) -> int:
        """Length of the cached prefix a new (or resumed) request could reuse; changes nothing."""
        return self.tree_cache.cached_prefix_len(self._prefix_key(req))

    def admit(self, req: Req) -> bool:
        """Give a waiting request a request slot and lock its cached prefix."""
        slot = self.req_to_token_pool.alloc()
        if slot is None:
            return False
        key = self._prefix_key(req)
        match = self.tree_cache.match_prefix(key)
        windows = self.windows
        if windows is not None:
            usable = windows.usable_prefix_len(match.slots)
            if usable < len(match.slots):
                match = self.tree_cache.match_prefix(key[:usable])
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

    @staticmethod
    def new_slots_needed(reqs: list[Req], extend_lens: list[int]) -> int:
        """Slots a step of these requests takes from the free ones (beyond their reserves)."""
        return sum(max(0, n - len(req.reserved_slots)) for req, n in zip(reqs, extend_lens, strict=True))

    @staticmethod
    def decode_slots_needed(decoding: list[Req]) -> int:
        """new_slots_needed for a decode token each: the requests with nothing in reserve."""
        return sum(not req.reserved_slots for req in decoding)

    def alloc_step(self, reqs: list[Req], extend_lens: list[int]) -> torch.Tensor | None:
        """A step's token slots, request after request (its out_cache_loc); None if there are
        too few. Each request takes its reserved slots first; where it needs more, it takes
        them in a run rounded up to SLOT_RUN and reserves the rest, from slots that are free
        anyway: only what the step needs is evicted from the cache. A sliding-window model
        reserves nothing (its window slots are sized for the tokens in use)."""
        needed = self.new_slots_needed(reqs, extend_lens)
        if self.allocator.available() < needed:
            self.tree_cache.evict(needed - self.allocator.available())
        if self.allocator.available() < needed:
            return None
        run = 1 if self.windows is not None else SLOT_RUN
        spare = self.allocator.available() - needed
        slots: list[int] = []
        for req, n in zip(reqs, extend_lens, strict=True):
            short = n - len(req.reserved_slots)
            if short > 0:
                extra = min(-short % run, spare)
                spare -= extra
                fresh = self.allocator.alloc(short + extra)
                assert fresh is not None, "the free slots were counted above"
                req.reserved_slots += fresh.tolist()
            slots += req.reserved_slots[:n]
            del req.reserved_slots[:n]
        return torch.tensor(slots, dtype=torch.int64)

    def cache_prefix(self, req: Req) -> None:
        """Hand the KV a running request has computed so far to the radix cache."""
        slots = req.kv_slots(self.req_to_token)
        self._keep_window_slots(req, slots)
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
        """Free a request's slots: into the cache (finished) or back to the allocator; its
        reserved slots back to the allocator."""
        if req.reserved_slots:
            self.allocator.free(torch.tensor(req.reserved_slots, dtype=torch.int64))
            req.reserved_slots = []
        if req.req_pool_idx is None:
            return
        slots = req.kv_slots(self.req_to_token)
        if keep_in_cache:
            self._keep_window_slots(req, slots)
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

    def _keep_window_slots(self, req: Req, slots: torch.Tensor) -> None:
        """Before the cache frees a request's slots that duplicate its own, move their window
        slots to the cache's tokens that lack them (a prefix the request computed again
        because its window was gone): the request's row will point at the cache's."""
        windows = self.windows
        if windows is None or self.tree_cache.disabled:
            return
        cached = self.tree_cache.match_prefix(req.fill_slice(0, req.kv_len)).slots
        start, end = req.locked_prefix_len, len(cached)
        if end > start:
            windows.move_window_slots(slots[start:end], cached[start:end])

    def trim_window_slots(self, running: list[Req]) -> None:
        """Drop window slots beyond `window_cache_tokens` outside the windows of `running`:
        the cache's least recently used tokens first (the earliest of a node first), then
        running requests' own tokens before their windows. A window's worth more goes each
        time, so that the walk over the cache comes every few steps, not every one (~8 ms
        over 300,000 cached tokens)."""
        windows = self.windows
        if windows is None or windows.window_slots_held() <= self.window_cache_tokens:
            return
        seen = [self._window_of(req, windows.window) for req in running]
        protected = torch.unique(torch.cat(seen)) if seen else torch.empty(0, dtype=torch.int64)
        excess = windows.window_slots_held() - protected.numel() - self.window_cache_tokens
        if excess <= 0:  # what is held beyond the budget is running requests' windows
            return
        own = [
            self.req_to_token[r.req_pool_idx, r.locked_prefix_len : self._window_start(r, windows.window)]
            for r in running
        ]
        in_order = torch.cat([node.value for node in self.tree_cache.nodes_by_last_use()] + own)
        held = (windows.window_slot_of[in_order] != 0) & ~torch.isin(in_order, protected)
        windows.drop_window_slots(in_order[held][: excess + windows.window])

    def _window_of(self, req: Req, window: int) -> torch.Tensor:
        """The token slots the next query of a running request may see through a window."""
        return self.req_to_token[req.req_pool_idx, self._window_start(req, window) : req.kv_len]

    @staticmethod
    def _window_start(req: Req, window: int) -> int:
        return max(0, req.kv_len - window)

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

    def check_windows(self, running: list[Req]) -> None:
        """Assert every running request's window has its window slots."""
        windows = self.windows
        if windows is None:
            return
        windows.check_window_slots()
        for req in running:
            if req.req_pool_idx is not None:
                seen = self._window_of(req, windows.window)
                assert bool((windows.window_slot_of[seen] != 0).all()), f"{req.rid} lost part of its window"

    @staticmethod
    def _prefix_key(req: Req) -> list[int]:
        # At least one token must be computed to get logits for the next one. A request
        # that wants prompt logprobs from position s needs the logits at s - 1.
        limit = 0 if req.needs_every_position else req.seq_len - 1
        if req.wants_input_logprobs:
            limit = min(limit, max(req.logprob_start_len - 1, 0))
        return req.fill_slice(0, limit)
