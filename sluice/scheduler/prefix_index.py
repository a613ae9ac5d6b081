"""What the DataParallelController guesses each replica's radix cache holds.

It never asks the replicas: it remembers the prompts it sent to each, cut into blocks of
BLOCK_TOKENS tokens, each block named by a hash chained over the blocks before it, so a
block's name stands for the whole prefix up to its end (an approximate prefix tree, as
sgl-router's cache-aware policy keeps). Each replica's names are kept in least-recently-used
order within a bound; a prompt's blocks are touched last to first, so a prefix outlives the
longer prompts that extend it.
"""

from __future__ import annotations

from collections import OrderedDict

BLOCK_TOKENS = 16
MAX_BLOCKS_PER_REPLICA = 1 << 18  # 4 M tokens of prompts per replica


class PrefixIndex:
    def __init__(self, num_replicas: int, max_blocks: int = MAX_BLOCKS_PER_REPLICA):
        self.max_blocks = max_blocks
        self.blocks: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_replicas)]

    @staticmethod
    def block_names(token_ids: list[int]) -> list[int]:
        """One name per whole block of the prompt, each standing for the prefix up to its end."""
        names, name = [], 0
        for start in range(0, len(token_ids) - BLOCK_TOKENS + 1, BLOCK_TOKENS):
            name = hash((name, *token_ids[start : start + BLOCK_TOKENS]))
            names.append(name)
        return names

    def matched_tokens(self, names: list[int], replica: int) -> int:
        """How many leading tokens of the prompt `replica` was last seen to hold."""
        held = self.blocks[replica]
        count = 0
        for name in names:
            if name not in held:
                break
            count += 1
        return count * BLOCK_TOKENS

    def insert(self, names: list[int], replica: int) -> None:
        held = self.blocks[replica]
        for name in reversed(names):
            held[name] = None
            held.move_to_end(name)
        while len(held) > self.max_blocks:
            held.popitem(last=False)

    def forget(self, replica: int) -> None:
        self.blocks[replica].clear()
