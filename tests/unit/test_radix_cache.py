import random
from dataclasses import dataclass

import pytest
import torch

from sluice.scheduler.memory_pool import TokenToKVSlotAllocator
from sluice.scheduler.radix_cache import RadixCache, TreeNode


def make_cache(num_slots: int = 64, disabled: bool = False) -> tuple[TokenToKVSlotAllocator, RadixCache]:
    allocator = TokenToKVSlotAllocator(num_slots)
    return allocator, RadixCache(allocator, disabled=disabled)


def insert_fresh(allocator: TokenToKVSlotAllocator, cache: RadixCache, token_ids: list[int]) -> torch.Tensor:
    """Insert a sequence with newly allocated slots, freeing the duplicates like a caller must."""
    slots = allocator.alloc(len(token_ids))
    already = cache.insert(token_ids, slots)
    allocator.free(slots[:already])
    return slots


def assert_all_slots_accounted(allocator: TokenToKVSlotAllocator, cache: RadixCache, held_outside: int = 0):
    cache.check_integrity()
    assert allocator.available() + cache.total_size() + held_outside == allocator.total


class TestMatchAndInsert:
    def test_empty_cache_matches_nothing(self):
        _, cache = make_cache()
        match = cache.match_prefix([1, 2, 3])
        assert match.slots.numel() == 0 and match.slots.dtype == torch.int64
        assert match.last_node is cache.root

    def test_full_and_partial_match_return_the_inserted_slots(self):
        allocator, cache = make_cache()
        slots = insert_fresh(allocator, cache, [1, 2, 3, 4])
        assert torch.equal(cache.match_prefix([1, 2, 3, 4]).slots, slots)
        assert torch.equal(cache.match_prefix([1, 2, 3, 4, 5, 6]).slots, slots)
        assert cache.match_prefix([9, 1, 2]).slots.numel() == 0

    def test_match_ending_inside_a_node_splits_it(self):
        allocator, cache = make_cache()
        slots = insert_fresh(allocator, cache, [1, 2, 3, 4, 5])
        match = cache.match_prefix([1, 2, 3, 7])
        assert torch.equal(match.slots, slots[:3])
        assert match.last_node.key == [1, 2, 3]
        (child,) = match.last_node.children.values()
        assert child.key == [4, 5]
        assert torch.equal(child.value, slots[3:])
        # The split keeps the whole sequence findable and the sizes unchanged.
        assert torch.equal(cache.match_prefix([1, 2, 3, 4, 5]).slots, slots)
        assert cache.total_size() == 5
        assert_all_slots_accounted(allocator, cache)

    def test_cached_prefix_len_neither_splits_nor_touches(self):
        """What the lpm policy asks about every waiting request on every step."""
        allocator, cache = make_cache()
        insert_fresh(allocator, cache, [1, 2, 3, 4, 5])
        insert_fresh(allocator, cache, [9, 9])
        (node,) = [n for n in cache.root.children.values() if n.key[0] == 1]
        touched = node.last_access_time
        assert cache.cached_prefix_len([1, 2, 3, 7]) == 3
        assert cache.cached_prefix_len([1, 2, 3, 4, 5, 6]) == 5
        assert cache.cached_prefix_len([8]) == 0
        assert node.key == [1, 2, 3, 4, 5] and not node.children  # not split
        assert node.last_access_time == touched
        assert cache.evict(1) == 5  # still the least recently used leaf
        assert cache.cached_prefix_len([1, 2, 3]) == 0
        assert cache.cached_prefix_len([9, 9]) == len(cache.match_prefix([9, 9]).slots) == 2
        _, disabled = make_cache(disabled=True)
        assert disabled.cached_prefix_len([1, 2]) == 0

    def test_insert_returns_the_length_already_cached(self):
        allocator, cache = make_cache()
        assert cache.insert([1, 2, 3], allocator.alloc(3)) == 0
        dup = allocator.alloc(5)
        assert cache.insert([1, 2, 3, 4, 5], dup) == 3
        allocator.free(dup[:3])  # the tree kept its own slots for [1, 2, 3]
        dup = allocator.alloc(4)
        assert cache.insert([1, 2, 9, 9], dup) == 2  # diverges inside a node
        allocator.free(dup[:2])
        dup = allocator.alloc(2)
        assert cache.insert([1, 2], dup) == 2  # fully contained: tree takes nothing
        allocator.free(dup)
        assert cache.total_size() == 7
        assert_all_slots_accounted(allocator, cache)

    def test_insert_keeps_the_trees_slots_for_the_shared_prefix(self):
        allocator, cache = make_cache()
        first = insert_fresh(allocator, cache, [1, 2, 3])
        second = insert_fresh(allocator, cache, [1, 2, 3, 4])
        assert torch.equal(cache.match_prefix([1, 2, 3, 4]).slots, torch.cat([first, second[3:]]))

    def test_insert_rejects_length_mismatch(self):
        allocator, cache = make_cache()
        with pytest.raises(ValueError):
            cache.insert([1, 2, 3], allocator.alloc(2))


class TestLocksAndEviction:
    def test_lock_moves_tokens_from_evictable_to_protected(self):
        allocator, cache = make_cache()
        insert_fresh(allocator, cache, [1, 2, 3, 4])
        node = cache.match_prefix([1, 2]).last_node  # splits: [1,2] -> [3,4]
        cache.inc_lock_ref(node)
        assert cache.protected_size() == 2 and cache.evictable_size() == 2
        cache.dec_lock_ref(node)
        assert cache.protected_size() == 0 and cache.evictable_size() == 4
        cache.check_integrity()

    def test_unlock_of_unlocked_node_raises(self):
        allocator, cache = make_cache()
        insert_fresh(allocator, cache, [1, 2])
        with pytest.raises(RuntimeError):
            cache.dec_lock_ref(cache.match_prefix([1, 2]).last_node)

    def test_locked_path_is_not_evicted_until_unlocked(self):
        allocator, cache = make_cache()
        insert_fresh(allocator, cache, [1, 2, 3])
        node = cache.match_prefix([1, 2, 3]).last_node
        cache.inc_lock_ref(node)
        assert cache.evict(100) == 0
        assert cache.match_prefix([1, 2, 3]).slots.numel() == 3
        cache.dec_lock_ref(node)
        assert cache.evict(100) == 3
        assert cache.match_prefix([1, 2, 3]).slots.numel() == 0
        assert_all_slots_accounted(allocator, cache)

    def test_locked_child_protects_its_ancestors(self):
        allocator, cache = make_cache()
        insert_fresh(allocator, cache, [1, 2, 3, 4])
        insert_fresh(allocator, cache, [1, 2, 7, 8])
        node = cache.match_prefix([1, 2, 3, 4]).last_node
        cache.inc_lock_ref(node)
        assert cache.evict(100) == 2  # only the unlocked sibling [7, 8]
        assert cache.match_prefix([1, 2, 3, 4]).slots.numel() == 4
        cache.dec_lock_ref(node)
        assert_all_slots_accounted(allocator, cache)

    def test_evicts_least_recently_used_leaf_first(self):
        allocator, cache = make_cache()
        insert_fresh(allocator, cache, [1, 1])
        insert_fresh(allocator, cache, [2, 2])
        insert_fresh(allocator, cache, [3, 3])
        cache.match_prefix([1, 1])  # [1,1] is now the most recent; [2,2] the oldest
        assert cache.evict(1) == 2
        assert cache.match_prefix([2, 2]).slots.numel() == 0
        assert cache.match_prefix([3, 3]).slots.numel() == 2
        assert cache.evict(1) == 2
        assert cache.match_prefix([1, 1]).slots.numel() == 0  # [3,3] was touched after [1,1]
        assert cache.match_prefix([3, 3]).slots.numel() == 2

    def test_parent_becomes_evictable_after_its_children(self):
        allocator, cache = make_cache()
        insert_fresh(allocator, cache, [1, 2, 3])
        insert_fresh(allocator, cache, [1, 2, 4])
        assert cache.evict(5) == 4  # both leaves (1 token each), then the shared [1, 2]
        assert cache.total_size() == 0
        assert allocator.available() == allocator.total

    def test_evict_returns_slots_to_the_allocator(self):
        allocator, cache = make_cache(num_slots=10)
        insert_fresh(allocator, cache, [1, 2, 3, 4])
        insert_fresh(allocator, cache, [5, 6, 7])
        assert allocator.available() == 3
        freed = cache.evict(3)
        assert freed >= 3
        assert allocator.available() == 3 + freed
        assert_all_slots_accounted(allocator, cache)


class TestCacheSequence:
    def test_running_request_moves_its_lock_and_frees_duplicates(self):
        allocator, cache = make_cache()
        insert_fresh(allocator, cache, [1, 2, 3, 4])  # another request computed this earlier
        # Our request matched only [1, 2] when admitted, then computed [3, 4, 5] itself.
        match = cache.match_prefix([1, 2])
        cache.inc_lock_ref(match.last_node)
        own = allocator.alloc(3)
        req_slots = torch.cat([match.slots, own])
        free_before = allocator.available()

        last_node, prefix_len = cache.cache_sequence([1, 2, 3, 4, 5], req_slots, match.last_node, 2)

        assert prefix_len == 5
        assert allocator.available() == free_before + 2  # own slots for [3, 4] were duplicates
        assert cache.protected_size() == 5 and cache.evictable_size() == 0
        assert last_node.lock_ref == 1 and match.last_node.lock_ref == 1  # the new path passes it
        tree_slots = cache.match_prefix([1, 2, 3, 4, 5]).slots
        assert tree_slots[4] == own[2]  # the tree took the request's slot for token 5
        assert_all_slots_accounted(allocator, cache)
        cache.dec_lock_ref(last_node)
        assert cache.protected_size() == 0

    def test_finished_request_gives_everything_away(self):
        allocator, cache = make_cache()
        match = cache.match_prefix([1, 2, 3])
        cache.inc_lock_ref(match.last_node)
        slots = allocator.alloc(3)
        last_node, prefix_len = cache.cache_sequence([1, 2, 3], slots, match.last_node, 0, keep_lock=False)
        assert (last_node, prefix_len) == (cache.root, 0)
        assert cache.protected_size() == 0 and cache.evictable_size() == 3
        assert_all_slots_accounted(allocator, cache, held_outside=0)

    def test_two_requests_with_the_same_prompt_share_one_copy(self):
        allocator, cache = make_cache()
        prompt = [5, 6, 7, 8]
        holders = []
        for _ in range(2):  # both admitted before either finished its prefill
            match = cache.match_prefix(prompt)
            cache.inc_lock_ref(match.last_node)
            holders.append((match.last_node, allocator.alloc(4)))
        for node, slots in holders:
            cache.cache_sequence(prompt, slots, node, 0, keep_lock=False)
        assert cache.total_size() == 4
        assert_all_slots_accounted(allocator, cache)


class TestDisabledAndReset:
    def test_disabled_cache_keeps_nothing(self):
        allocator, cache = make_cache(disabled=True)
        slots = allocator.alloc(3)
        assert cache.insert([1, 2, 3], slots) == 0
        assert cache.match_prefix([1, 2, 3]).slots.numel() == 0
        assert cache.total_size() == 0
        assert cache.evict(10) == 0
        allocator.free(slots)  # insert kept nothing, so the caller still owns all slots
        assert allocator.available() == allocator.total

    def test_disabled_cache_sequence(self):
        allocator, cache = make_cache(disabled=True)
        match = cache.match_prefix([1, 2, 3])
        cache.inc_lock_ref(match.last_node)
        slots = allocator.alloc(3)
        # Still running: the request keeps its slots.
        assert cache.cache_sequence([1, 2, 3], slots, match.last_node, 0) == (cache.root, 0)
        assert allocator.available() == allocator.total - 3
        # Finished: its slots go back to the allocator.
        cache.cache_sequence([1, 2, 3], slots, cache.root, 0, keep_lock=False)
        assert allocator.available() == allocator.total

    def test_reset_frees_everything(self):
        allocator, cache = make_cache()
        insert_fresh(allocator, cache, [1, 2, 3])
        insert_fresh(allocator, cache, [1, 4])
        cache.reset()
        assert cache.total_size() == 0
        assert allocator.available() == allocator.total
        assert cache.match_prefix([1, 2, 3]).slots.numel() == 0
        cache.check_integrity()

    def test_reset_refuses_while_a_request_holds_a_lock(self):
        allocator, cache = make_cache()
        insert_fresh(allocator, cache, [1, 2, 3])
        cache.inc_lock_ref(cache.match_prefix([1, 2, 3]).last_node)
        with pytest.raises(RuntimeError, match="locked"):
            cache.reset()
        assert cache.total_size() == 3


@dataclass
class SimRequest:
    token_ids: list[int]  # tokens whose KV are computed
    slots: torch.Tensor  # their KV slots; [:prefix_len] are the tree's, the rest its own
    last_node: TreeNode
    prefix_len: int

    def owned(self) -> int:
        return self.slots.numel() - self.prefix_len


@pytest.mark.parametrize("seed", range(4))
def test_randomized_requests_keep_every_slot_accounted_for(seed):
    rng = random.Random(seed)
    allocator, cache = make_cache(num_slots=120)
    # What each slot "holds": the token prefix its K/V was computed for. The tree must only
    # ever hand a prefix the slots that were computed for exactly that prefix.
    kv_content: dict[int, tuple[int, ...]] = {}
    system_prompts = [[rng.randrange(50) for _ in range(rng.randint(3, 12))] for _ in range(3)]
    running: list[SimRequest] = []

    def compute_kv(req: SimRequest, new_tokens: list[int]) -> bool:
        slots = allocator.alloc(len(new_tokens))
        if slots is None:
            cache.evict(len(new_tokens) - allocator.available())
            slots = allocator.alloc(len(new_tokens))
        if slots is None:
            return False
        for i, slot in enumerate(slots.tolist()):
            kv_content[slot] = tuple(req.token_ids + new_tokens[: i + 1])
        req.token_ids = req.token_ids + new_tokens
        req.slots = torch.cat([req.slots, slots])
        return True

    def check_match(token_ids: list[int]) -> None:
        match = cache.match_prefix(token_ids)
        for i, slot in enumerate(match.slots.tolist()):
            assert kv_content[slot] == tuple(token_ids[: i + 1])

    def admit() -> None:
        prompt = rng.choice(system_prompts) + [rng.randrange(50) for _ in range(rng.randint(1, 8))]
        match = cache.match_prefix(prompt[:-1])
        cache.inc_lock_ref(match.last_node)
        req = SimRequest(prompt[: len(match.slots)], match.slots, match.last_node, len(match.slots))
        if compute_kv(req, prompt[req.prefix_len :]):
            running.append(req)
        else:
            cache.dec_lock_ref(req.last_node)

    def share_progress(req: SimRequest) -> None:
        req.last_node, req.prefix_len = cache.cache_sequence(req.token_ids, req.slots, req.last_node, req.prefix_len)
        tree_slots = cache.match_prefix(req.token_ids).slots
        req.slots = torch.cat([tree_slots, req.slots[req.prefix_len :]])

    def finish(req: SimRequest) -> None:
        running.remove(req)
        cache.cache_sequence(req.token_ids, req.slots, req.last_node, req.prefix_len, keep_lock=False)

    def abort(req: SimRequest) -> None:
        running.remove(req)
        allocator.free(req.slots[req.prefix_len :])
        cache.dec_lock_ref(req.last_node)

    for _ in range(400):
        op = rng.random()
        if op < 0.3 or not running:
            admit()
        elif op < 0.5:
            req = rng.choice(running)
            compute_kv(req, [rng.randrange(50) for _ in range(rng.randint(1, 4))])  # decode steps
        elif op < 0.65:
            share_progress(rng.choice(running))
        elif op < 0.85:
            finish(rng.choice(running))
        elif op < 0.9:
            abort(rng.choice(running))
        else:
            cache.evict(rng.randint(1, 30))
        check_match([*rng.choice(system_prompts), rng.randrange(50)])
        for req in running:
            check_match(req.token_ids)
        assert_all_slots_accounted(allocator, cache, held_outside=sum(r.owned() for r in running))
        assert cache.protected_size() <= sum(r.prefix_len for r in running)

    for req in list(running):
        finish(req)
    assert cache.protected_size() == 0
    assert_all_slots_accounted(allocator, cache)
    cache.evict(allocator.total)
    assert cache.total_size() == 0
    assert allocator.available() == allocator.total
