"""Radix prefix cache: requests that share a token prefix share its KV slots.

A radix tree keyed by token ids. Each node holds a segment of tokens and the KV slots
that hold their K/V (same length). A node with ``lock_ref > 0`` is used by a running
request, and so are its ancestors (locks run from a node to the root); only unlocked
leaves are evicted, least recently used first.

How the Scheduler drives it, for one request (``row`` is its ReqToTokenPool row):

1. Admission::

       match = cache.match_prefix(prompt_ids[:-1])   # >= 1 token must be prefilled:
       cache.inc_lock_ref(match.last_node)           # its logits give the first token
       prefix_len = len(match.slots)
       req_to_token[row, :prefix_len] = match.slots
       # allocate slots for prompt_ids[prefix_len:], calling cache.evict() if short

2. After a prefill (or a prefill chunk), to share what it just computed::

       last_node, prefix_len = cache.cache_sequence(ids_with_kv, slots_of(ids_with_kv),
                                                    last_node, prefix_len)
       # some of its slots were duplicates and are freed: use the tree's instead
       req_to_token[row, :prefix_len] = cache.match_prefix(ids_with_kv).slots

3. When it finishes (or is aborted)::

       cache.cache_sequence(ids_with_kv, slots_of(ids_with_kv), last_node, prefix_len,
                            keep_lock=False)
       # the request now owns no KV slots; release its ReqToTokenPool row

``ids_with_kv`` are only tokens whose K/V exist: the token sampled last has none yet.

Slot ownership. While a request holds ``(last_node, prefix_len)``, ``slots[:prefix_len]``
belong to the tree (locked, so they stay) and ``slots[prefix_len:]`` belong to the
request. ``insert(ids, slots)`` returns ``already``, the length of the prefix that was
in the tree before the call; it takes ownership of ``slots[already:]``. The tree holds
its own slots for ``ids[:already]``, so ``slots[prefix_len:already]`` computed the same
K/V a second time: the caller frees them (and, if still running, points its row at the
tree's slots instead). ``cache_sequence`` does this for the caller.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from sluice.scheduler.memory_pool import TokenToKVSlotAllocator

_NO_SLOTS = torch.empty(0, dtype=torch.int64)


@dataclass(slots=True, eq=False)
class TreeNode:
    key: list[int]
    value: torch.Tensor  # int64 KV slots, one per token of ``key``
    parent: TreeNode | None
    children: dict[int, TreeNode] = field(default_factory=dict)  # keyed by child.key[0]
    lock_ref: int = 0  # running requests whose locked path passes through this node
    last_access_time: int = 0

    def __len__(self) -> int:
        return len(self.key)


class MatchResult(NamedTuple):
    slots: torch.Tensor  # int64 KV slots of the matched prefix
    last_node: TreeNode  # the node where the matched prefix ends


class CachedPrefix(NamedTuple):
    """What a request holds in the tree after ``cache_sequence``."""

    last_node: TreeNode  # locked for the request (the root when it holds nothing)
    prefix_len: int  # its first ``prefix_len`` tokens' slots now belong to the tree


def _shared_prefix_len(key: list[int], token_ids: list[int], start: int) -> int:
    """Length of the common prefix of ``key`` and ``token_ids[start:]``."""
    if token_ids[start : start + len(key)] == key:  # common case, compared in C
        return len(key)
    limit = min(len(key), len(token_ids) - start)
    i = 0
    while i < limit and key[i] == token_ids[start + i]:
        i += 1
    return i


class RadixCache:
    def __init__(self, allocator: TokenToKVSlotAllocator, disabled: bool = False) -> None:
        self.allocator = allocator
        self.disabled = disabled
        self._clock = itertools.count(1)
        self._start_empty()

    # ---- sizes -------------------------------------------------------------------

    def evictable_size(self) -> int:
        """Tokens in nodes no running request holds."""
        return self._evictable_size

    def protected_size(self) -> int:
        """Tokens in nodes locked by running requests."""
        return self._protected_size

    def total_size(self) -> int:
        return self._evictable_size + self._protected_size

    # ---- lookup and insertion ----------------------------------------------------

    def match_prefix(self, token_ids: list[int]) -> MatchResult:
        """The longest cached prefix of ``token_ids``; splits a node the match ends inside,
        so that ``last_node`` ends exactly at the match."""
        if self.disabled:
            return MatchResult(_NO_SLOTS, self.root)
        now = next(self._clock)
        node, pos, values = self.root, 0, []
        while pos < len(token_ids):
            child = node.children.get(token_ids[pos])
            if child is None:
                break
            shared = _shared_prefix_len(child.key, token_ids, pos)
            ends_inside_child = shared < len(child)
            if ends_inside_child:
                child = self._split(child, shared)
            child.last_access_time = now
            values.append(child.value)
            node, pos = child, pos + shared
            if ends_inside_child:
                break
        slots = torch.cat(values) if values else _NO_SLOTS
        return MatchResult(slots, node)

    def cached_prefix_len(self, token_ids: list[int]) -> int:
        """Length of the longest cached prefix of ``token_ids``, read-only: no node is split
        and no access time changes, so asking about every waiting request each step (the
        lpm policy) neither reshapes the tree nor makes unused entries look recently used."""
        if self.disabled:
            return 0
        node, pos = self.root, 0
        while pos < len(token_ids):
            child = node.children.get(token_ids[pos])
            if child is None:
                break
            shared = _shared_prefix_len(child.key, token_ids, pos)
            pos += shared
            if shared < len(child):
                break
            node = child
        return pos

    def insert(self, token_ids: list[int], slots: torch.Tensor) -> int:
        """Add ``token_ids`` with their KV ``slots``; returns how many leading tokens were
        already cached. The tree takes ownership of ``slots[returned:]``; the rest stay
        the caller's (see the module docstring). Disabled: keeps nothing, returns 0."""
        if len(token_ids) != slots.numel():
            raise ValueError(f"{len(token_ids)} token ids but {slots.numel()} slots")
        if self.disabled:
            return 0
        now = next(self._clock)
        node, pos = self.root, 0
        while pos < len(token_ids):
            child = node.children.get(token_ids[pos])
            if child is None:
                leaf = TreeNode(
                    key=list(token_ids[pos:]),
                    value=slots[pos:].clone(),
                    parent=node,
                    last_access_time=now,
                )
                node.children[leaf.key[0]] = leaf
                self._evictable_size += len(leaf)
                return pos
            shared = _shared_prefix_len(child.key, token_ids, pos)
            if shared < len(child):
                # The new sequence diverges inside ``child`` (or ends there): split so the
                # divergence falls on a node boundary; the next lookup misses.
                child = self._split(child, shared)
            child.last_access_time = now
            node, pos = child, pos + shared
        return pos

    def _split(self, node: TreeNode, prefix_len: int) -> TreeNode:
        """Cut ``node`` after ``prefix_len`` tokens and return the new upper part.

        ``node`` stays the lower part, so locks and MatchResults that name it still end
        at the same depth. The upper part inherits its lock count: every lock through
        ``node`` also passes through it."""
        assert 0 < prefix_len < len(node)
        parent = node.parent
        assert parent is not None
        upper = TreeNode(
            key=node.key[:prefix_len],
            value=node.value[:prefix_len],
            parent=parent,
            children={node.key[prefix_len]: node},
            lock_ref=node.lock_ref,
            last_access_time=node.last_access_time,
        )
        parent.children[upper.key[0]] = upper
        node.key = node.key[prefix_len:]
        node.value = node.value[prefix_len:]
        node.parent = upper
        return upper

    # ---- locks -------------------------------------------------------------------

    def inc_lock_ref(self, node: TreeNode) -> None:
        """Protect ``node`` and its ancestors from eviction."""
        while node is not self.root:
            if node.lock_ref == 0:
                self._evictable_size -= len(node)
                self._protected_size += len(node)
            node.lock_ref += 1
            assert node.parent is not None
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref <= 0:
                raise RuntimeError("dec_lock_ref on a node that is not locked")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._protected_size -= len(node)
                self._evictable_size += len(node)
            assert node.parent is not None
            node = node.parent

    # ---- the request-facing dance ------------------------------------------------

    def cache_sequence(
        self,
        token_ids: list[int],
        slots: torch.Tensor,
        old_node: TreeNode,
        old_prefix_len: int,
        keep_lock: bool = True,
    ) -> CachedPrefix:
        """Give a request's computed KV to the tree, free its duplicate slots, move its lock.

        ``old_node``/``old_prefix_len`` are what the request holds now; ``token_ids`` and
        ``slots`` are its tokens whose K/V exist, with their slots. Returns what it holds
        afterwards: with ``keep_lock`` (still running) the whole of ``token_ids``, locked;
        the caller must then point its row's first ``prefix_len`` positions at the tree's
        slots (``match_prefix(token_ids)``), as some were freed as duplicates. Without
        ``keep_lock`` (finished) its lock is dropped and it owns none of ``slots``.
        Disabled: nothing is cached; a finished request's slots are all freed."""
        if len(token_ids) != slots.numel():
            raise ValueError(f"{len(token_ids)} token ids but {slots.numel()} slots")
        if self.disabled:
            if not keep_lock:
                self.allocator.free(slots[old_prefix_len:])
            return CachedPrefix(self.root, 0)
        already_cached = self.insert(token_ids, slots)
        # The locked prefix cannot have been evicted, so insert found all of it.
        assert already_cached >= old_prefix_len, (already_cached, old_prefix_len)
        self.allocator.free(slots[old_prefix_len:already_cached])
        if not keep_lock:
            self.dec_lock_ref(old_node)
            return CachedPrefix(self.root, 0)
        new_node = self.match_prefix(token_ids).last_node
        self.inc_lock_ref(new_node)  # before the unlock, so the shared path is never bare
        self.dec_lock_ref(old_node)
        return CachedPrefix(new_node, len(token_ids))

    # ---- eviction ----------------------------------------------------------------

    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` KV slots from unlocked leaves, least recently used
        first, or as many as there are; returns the number freed."""
        if self.disabled or num_tokens <= 0:
            return 0
        tie_breaker = itertools.count()
        heap = [(leaf.last_access_time, next(tie_breaker), leaf) for leaf in self._evictable_leaves()]
        heapq.heapify(heap)
        freed_values: list[torch.Tensor] = []
        num_freed = 0
        while num_freed < num_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.key[0]]
            leaf.parent = None
            freed_values.append(leaf.value)
            num_freed += len(leaf)
            self._evictable_size -= len(leaf)
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access_time, next(tie_breaker), parent))
        if freed_values:
            self.allocator.free(torch.cat(freed_values))
        return num_freed

    def _evictable_leaves(self) -> list[TreeNode]:
        return [n for n in self._all_nodes() if not n.children and n.lock_ref == 0]

    def _all_nodes(self) -> list[TreeNode]:
        """Every node except the root."""
        nodes, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            nodes.append(node)
            stack.extend(node.children.values())
        return nodes

    def nodes_by_last_use(self) -> list[TreeNode]:
        """Every node except the root, least recently used first; of nodes last used together,
        those nearer the root first (a sequence from its start)."""
        by_depth, level = [], list(self.root.children.values())
        while level:
            by_depth += level
            level = [child for node in level for child in node.children.values()]
        return sorted(by_depth, key=lambda node: node.last_access_time)  # stable: depth order kept

    def reset(self) -> None:
        """Drop the whole tree and free its slots. Only valid while no request holds a
        lock: a held node would otherwise be freed under its request."""
        if self._protected_size:
            raise RuntimeError(f"cannot reset: {self._protected_size} cached tokens are locked by requests")
        values = [n.value for n in self._all_nodes()]
        if values:
            self.allocator.free(torch.cat(values))
        self._start_empty()

    def _start_empty(self) -> None:
        self.root = TreeNode(key=[], value=_NO_SLOTS, parent=None)
        self._evictable_size = 0
        self._protected_size = 0

    # ---- invariants --------------------------------------------------------------

    def check_integrity(self) -> None:
        """Assert the tree agrees with its size counters and with the allocator."""
        evictable = protected = 0
        values = []
        for node in self._all_nodes():
            assert len(node) > 0 and node.value.numel() == len(node), "key and value lengths differ"
            assert node.parent is not None and node.parent.children.get(node.key[0]) is node
            assert node.lock_ref >= 0, "negative lock_ref"
            # Every lock that passes through a child also passes through its parent.
            assert node.lock_ref >= sum(c.lock_ref for c in node.children.values())
            if node.lock_ref > 0:
                protected += len(node)
            else:
                evictable += len(node)
            values.append(node.value)
        assert evictable == self._evictable_size, (evictable, self._evictable_size)
        assert protected == self._protected_size, (protected, self._protected_size)
        if values:
            all_slots = torch.cat(values)
            assert torch.unique(all_slots).numel() == all_slots.numel(), "a KV slot is cached twice"
            assert self.allocator.are_allocated(all_slots), "the tree holds a free KV slot"
