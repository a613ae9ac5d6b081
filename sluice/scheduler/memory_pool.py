"""Slot bookkeeping for the KV cache: which request rows and which KV rows are in use.

Two tables, neither of which holds KV data itself (the model runner allocates the K/V
tensors and indexes them with the numbers handed out here):

- ``ReqToTokenPool``: one row per running request, mapping each position of its
  sequence to the KV slot that holds that position's K/V.
- ``TokenToKVSlotAllocator``: hands out KV slots one token at a time. Slot 0 is never
  handed out: the model pads its gathers with it, so the K/V tensors have
  ``num_slots + 1`` rows and rows ``1..num_slots`` are usable.
"""

from __future__ import annotations

import torch

from sluice.model.attention import PADDING_SLOT  # the slot the model pads with; never handed out


class ReqToTokenPool:
    """Rows of ``req_to_token`` lent to running requests, one row per request."""

    def __init__(self, size: int, max_context_len: int, device: str | torch.device = "cpu") -> None:
        if size <= 0 or max_context_len <= 0:
            raise ValueError(f"size ({size}) and max_context_len ({max_context_len}) must be positive")
        self.size = size
        self.max_context_len = max_context_len
        # Zero-filled so an unwritten position gathers the padding slot, never garbage.
        self.req_to_token = torch.zeros((size, max_context_len), dtype=torch.int64, device=device)
        # Reversed so that the first alloc() returns row 0; pop() from the end is O(1).
        self._free_rows: list[int] = list(range(size - 1, -1, -1))
        self._row_is_free = [True] * size

    def alloc(self) -> int | None:
        """A free request row, or None when every row is lent out."""
        if not self._free_rows:
            return None
        row = self._free_rows.pop()
        self._row_is_free[row] = False
        return row

    def free(self, slot: int) -> None:
        if not 0 <= slot < self.size:
            raise ValueError(f"request slot {slot} is outside 0..{self.size - 1}")
        if self._row_is_free[slot]:
            raise ValueError(f"request slot {slot} is already free (double free)")
        self._row_is_free[slot] = True
        self._free_rows.append(slot)

    def available(self) -> int:
        return len(self._free_rows)


class TokenToKVSlotAllocator:
    """Hands out KV slots ``1..num_slots`` one token at a time.

    The free slots live in a preallocated stack (``_free_stack[:_num_free]``), so alloc
    and free cost O(n) in the number of slots moved, never O(total): both run on every
    decode step. A per-slot "is free" mask makes double frees an O(n) check.
    """

    def __init__(self, num_slots: int) -> None:
        if num_slots <= 0:
            raise ValueError(f"num_slots ({num_slots}) must be positive")
        self._total = num_slots
        # Descending so the top of the stack (the end) is slot 1: early allocations get
        # low slot numbers, which makes logs and tests easy to read.
        self._free_stack = torch.arange(num_slots, 0, -1, dtype=torch.int64)
        self._num_free = num_slots
        self._slot_is_free = torch.ones(num_slots + 1, dtype=torch.bool)
        self._slot_is_free[PADDING_SLOT] = False

    @property
    def total(self) -> int:
        """Usable slots (excluding the padding slot)."""
        return self._total

    def available(self) -> int:
        return self._num_free

    def alloc(self, n: int) -> torch.Tensor | None:
        """``n`` free slots as an int64 tensor, or None (never a partial grant)."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of slots ({n})")
        if n > self._num_free:
            return None
        start = self._num_free - n
        # Clone: the stack region is overwritten by later frees.
        slots = self._free_stack[start : self._num_free].flip(0).clone()
        self._num_free = start
        self._slot_is_free[slots] = False
        return slots

    def free(self, slots: torch.Tensor) -> None:
        slots = slots.reshape(-1)
        n = slots.numel()
        if n == 0:
            return
        if slots.dtype != torch.int64:
            raise TypeError(f"slots must be int64, got {slots.dtype}")
        if int(slots.min()) < 1 or int(slots.max()) > self._total:
            raise ValueError(f"slots must lie in 1..{self._total}")
        if bool(self._slot_is_free[slots].any()):
            raise ValueError("double free: some slots are already free")
        if n > 1 and torch.unique(slots).numel() != n:
            raise ValueError("double free: the same slot appears twice in one free() call")
        self._slot_is_free[slots] = True
        # Pushed last first, so that alloc() hands a freed run out again in its order.
        self._free_stack[self._num_free : self._num_free + n] = slots.flip(0)
        self._num_free += n

    def are_allocated(self, slots: torch.Tensor) -> bool:
        """True when every slot in ``slots`` is currently handed out (for integrity checks)."""
        slots = slots.reshape(-1)
        if slots.numel() == 0:
            return True
        if int(slots.min()) < 1 or int(slots.max()) > self._total:
            return False
        return not bool(self._slot_is_free[slots].any())


class SlidingWindowSlotAllocator(TokenToKVSlotAllocator):
    """Token slots for a model with sliding-window layers (Gemma 2 and 3), whose K/V live in
    a slot space of their own so that they can be dropped once no query can see them.

    Each token takes a slot of this allocator, which indexes the global layers' K/V and is
    the token's name everywhere else (request rows, the radix cache). While a query may still
    see the token, it also holds a window slot: ``window_slot_of[slot]`` indexes the
    sliding-window layers' K/V, and is 0 (the padding slot) once dropped. Freeing a token
    slot drops its window slot; ``drop_window_slots`` drops only the window slot and keeps the
    token for the global layers.

    A token holds at most one window slot, and the owner sizes the window slots for the most
    it keeps at once (ServerArgs.window_slots_needed; or as many as token slots), so when a
    token slot is granted a window slot always is: admission counts token slots only. The
    window slots are handed out from a stack like the token slots, so the pages of the
    window layers' pools in use stay those of the window slots held at once.
    """

    def __init__(self, num_slots: int, window: int, num_window_slots: int | None = None) -> None:
        super().__init__(num_slots)
        if window <= 0:
            raise ValueError(f"window ({window}) must be positive")
        self.window = window
        self._window_slots = TokenToKVSlotAllocator(num_window_slots or num_slots)
        self.window_slot_of = torch.zeros(num_slots + 1, dtype=torch.int64)

    def window_slots_held(self) -> int:
        return self._window_slots.total - self._window_slots.available()

    def alloc(self, n: int) -> torch.Tensor | None:
        slots = super().alloc(n)
        if slots is None:
            return None
        window_slots = self._window_slots.alloc(n)
        if window_slots is None:
            super().free(slots)
            raise RuntimeError(f"out of window slots: {n} wanted, {self._window_slots.available()} free")
        self.window_slot_of[slots] = window_slots
        return slots

    def free(self, slots: torch.Tensor) -> None:
        super().free(slots)
        self.drop_window_slots(slots)

    def drop_window_slots(self, slots: torch.Tensor) -> None:
        """Drop the window slots of ``slots`` (those that still have one)."""
        window_slots = self.window_slot_of[slots.reshape(-1)]
        held = window_slots[window_slots != PADDING_SLOT]
        if held.numel():
            self._window_slots.free(held)
        self.window_slot_of[slots] = PADDING_SLOT

    def move_window_slots(self, source: torch.Tensor, target: torch.Tensor) -> None:
        """Give each ``target`` token without a window slot the one of the ``source`` token
        at the same position (the same token computed twice: its K/V are the same)."""
        moving = (self.window_slot_of[target] == PADDING_SLOT) & (self.window_slot_of[source] != PADDING_SLOT)
        self.window_slot_of[target[moving]] = self.window_slot_of[source[moving]]
        self.window_slot_of[source[moving]] = PADDING_SLOT

    def usable_prefix_len(self, slots: torch.Tensor) -> int:
        """The longest prefix of a sequence (``slots``, in order) that a request can continue
        from: the window before its end has every window slot, so the next query sees all it
        should. 0 when there is none."""
        present = self.window_slot_of[slots] != PADDING_SLOT
        n = present.numel()
        if n == 0 or bool(present[max(0, n - self.window) :].all()):
            return n
        positions = torch.arange(n)
        # For each position, the last one at or before it without a window slot (-1: none).
        last_missing = torch.cummax(torch.where(present, -1, positions), dim=0).values
        ends = positions + 1  # a prefix of length m ends at position m - 1
        usable = last_missing < (ends - self.window).clamp(min=0)
        found = usable.nonzero()
        return int(found[-1]) + 1 if found.numel() else 0

    def check_window_slots(self) -> None:
        """Assert the window slots agree with the token slots and with their own allocator."""
        mapped = self.window_slot_of.nonzero().reshape(-1)
        assert self.are_allocated(mapped), "a free token slot holds a window slot"
        window_slots = self.window_slot_of[mapped]
        assert torch.unique(window_slots).numel() == window_slots.numel(), "a window slot is held twice"
        assert window_slots.numel() == self.window_slots_held(), "window slots leaked"
        assert self._window_slots.are_allocated(window_slots), "a token holds a free window slot"
