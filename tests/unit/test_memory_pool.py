import pytest
import torch

from sluice.scheduler.memory_pool import (
    PADDING_SLOT,
    ReqToTokenPool,
    SlidingWindowSlotAllocator,
    TokenToKVSlotAllocator,
)


class TestReqToTokenPool:
    def test_table_shape_and_dtype(self):
        pool = ReqToTokenPool(size=4, max_context_len=16)
        assert pool.req_to_token.shape == (4, 16)
        assert pool.req_to_token.dtype == torch.int64

    def test_alloc_until_exhausted_then_none(self):
        pool = ReqToTokenPool(size=3, max_context_len=8)
        rows = [pool.alloc() for _ in range(3)]
        assert sorted(rows) == [0, 1, 2]
        assert pool.available() == 0
        assert pool.alloc() is None

    def test_free_makes_row_reusable(self):
        pool = ReqToTokenPool(size=2, max_context_len=8)
        first = pool.alloc()
        pool.alloc()
        pool.free(first)
        assert pool.available() == 1
        assert pool.alloc() == first

    def test_double_free_raises(self):
        pool = ReqToTokenPool(size=2, max_context_len=8)
        row = pool.alloc()
        pool.free(row)
        with pytest.raises(ValueError, match="already free"):
            pool.free(row)

    def test_free_of_never_allocated_or_out_of_range_row_raises(self):
        pool = ReqToTokenPool(size=2, max_context_len=8)
        with pytest.raises(ValueError):
            pool.free(1)
        with pytest.raises(ValueError):
            pool.free(2)


class TestTokenToKVSlotAllocator:
    def test_never_hands_out_the_padding_slot(self):
        allocator = TokenToKVSlotAllocator(num_slots=10)
        slots = allocator.alloc(10)
        assert slots is not None
        assert sorted(slots.tolist()) == list(range(1, 11))
        assert PADDING_SLOT not in slots.tolist()

    def test_accounting(self):
        allocator = TokenToKVSlotAllocator(num_slots=10)
        assert allocator.total == 10
        assert allocator.available() == 10
        a = allocator.alloc(3)
        b = allocator.alloc(4)
        assert a.dtype == torch.int64 and a.numel() == 3 and b.numel() == 4
        assert set(a.tolist()).isdisjoint(b.tolist())
        assert allocator.available() == 3
        allocator.free(a)
        assert allocator.available() == 6
        allocator.free(b)
        assert allocator.available() == 10

    def test_none_on_exhaustion_and_no_partial_grant(self):
        allocator = TokenToKVSlotAllocator(num_slots=5)
        allocator.alloc(3)
        assert allocator.alloc(3) is None
        assert allocator.available() == 2  # the failed call took nothing
        assert allocator.alloc(2) is not None
        assert allocator.alloc(1) is None

    def test_alloc_zero_gives_empty_tensor(self):
        allocator = TokenToKVSlotAllocator(num_slots=5)
        slots = allocator.alloc(0)
        assert slots is not None and slots.numel() == 0
        assert allocator.available() == 5

    def test_freed_slots_are_reused_and_returned_tensor_is_not_aliased(self):
        allocator = TokenToKVSlotAllocator(num_slots=4)
        held = allocator.alloc(2)
        held_copy = held.clone()
        other = allocator.alloc(2)
        allocator.free(other)
        again = allocator.alloc(2)
        assert sorted(again.tolist()) == sorted(other.tolist())
        assert torch.equal(held, held_copy)  # later frees must not write into a grant

    def test_double_free_raises(self):
        allocator = TokenToKVSlotAllocator(num_slots=4)
        slots = allocator.alloc(2)
        allocator.free(slots)
        with pytest.raises(ValueError, match="double free"):
            allocator.free(slots[:1])
        assert allocator.available() == 4

    def test_duplicate_slot_in_one_free_raises(self):
        allocator = TokenToKVSlotAllocator(num_slots=4)
        slots = allocator.alloc(2)
        with pytest.raises(ValueError, match="double free"):
            allocator.free(torch.stack([slots[0], slots[0]]))

    def test_freeing_padding_or_out_of_range_slot_raises(self):
        allocator = TokenToKVSlotAllocator(num_slots=4)
        allocator.alloc(4)
        with pytest.raises(ValueError):
            allocator.free(torch.tensor([PADDING_SLOT]))
        with pytest.raises(ValueError):
            allocator.free(torch.tensor([5]))

    def test_are_allocated(self):
        allocator = TokenToKVSlotAllocator(num_slots=4)
        slots = allocator.alloc(2)
        assert allocator.are_allocated(slots)
        allocator.free(slots[:1])
        assert not allocator.are_allocated(slots)
        assert not allocator.are_allocated(torch.tensor([PADDING_SLOT]))


class TestSlidingWindowSlotAllocator:
    def test_every_granted_token_has_its_own_window_slot(self):
        slots = SlidingWindowSlotAllocator(8, window=3)
        granted = slots.alloc(5)
        window_slots = slots.window_slot_of[granted]
        assert bool((window_slots != PADDING_SLOT).all())
        assert torch.unique(window_slots).numel() == 5
        assert slots.window_slots_held() == 5
        slots.check_window_slots()

    def test_freeing_a_token_frees_its_window_slot_too(self):
        slots = SlidingWindowSlotAllocator(4, window=2)
        granted = slots.alloc(4)
        slots.free(granted[:2])
        assert slots.available() == 2 and slots.window_slots_held() == 2
        assert bool((slots.window_slot_of[granted[:2]] == PADDING_SLOT).all())
        slots.check_window_slots()
        # Dropped window slots are handed out again with the freed tokens.
        assert slots.alloc(2) is not None
        assert slots.window_slots_held() == 4

    def test_dropping_a_window_slot_keeps_the_token(self):
        slots = SlidingWindowSlotAllocator(6, window=2)
        granted = slots.alloc(6)
        slots.drop_window_slots(granted[:4])
        slots.drop_window_slots(granted[:4])  # dropping twice changes nothing
        assert slots.available() == 0 and slots.window_slots_held() == 2
        slots.free(granted)
        assert slots.available() == 6 and slots.window_slots_held() == 0
        slots.check_window_slots()

    def test_a_prefix_is_usable_up_to_where_its_window_is_whole(self):
        slots = SlidingWindowSlotAllocator(20, window=3)
        seq = slots.alloc(10)
        assert slots.usable_prefix_len(seq) == 10
        assert slots.usable_prefix_len(seq[:0]) == 0
        slots.drop_window_slots(seq[:5])  # positions 0..4 lost: a prefix must end at 8 or later
        assert slots.usable_prefix_len(seq) == 10
        assert slots.usable_prefix_len(seq[:8]) == 8
        assert slots.usable_prefix_len(seq[:7]) == 0
        slots.drop_window_slots(seq[8:9])  # and 8: the longest prefix now ends before it
        assert slots.usable_prefix_len(seq) == 8
        slots.drop_window_slots(seq[5:8])
        assert slots.usable_prefix_len(seq[:5]) == 0

    def test_moving_window_slots_fills_only_the_tokens_that_lack_them(self):
        slots = SlidingWindowSlotAllocator(8, window=2)
        cached, again = slots.alloc(3), slots.alloc(3)
        slots.drop_window_slots(cached[:2])
        moved = slots.window_slot_of[again[:2]].clone()
        kept = slots.window_slot_of[cached[2]].item()
        slots.move_window_slots(again, cached)
        assert slots.window_slot_of[cached[:2]].tolist() == moved.tolist()
        assert slots.window_slot_of[cached[2]].item() == kept
        assert slots.window_slot_of[again[:2]].tolist() == [PADDING_SLOT, PADDING_SLOT]
        slots.free(again)  # the duplicates go; the cached tokens keep what they were given
        assert slots.window_slots_held() == 3
        slots.check_window_slots()
