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
        self._free_stack[self._num_free : self._num_free + n] = slots
        self._num_free += n

    def are_allocated(self, slots: torch.Tensor) -> bool:
        """True when every slot in ``slots`` is currently handed out (for integrity checks)."""
        slots = slots.reshape(-1)
        if slots.numel() == 0:
            return True
        if int(slots.min()) < 1 or int(slots.max()) > self._total:
            return False
        return not bool(self._slot_is_free[slots].any())
