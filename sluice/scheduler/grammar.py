"""The Scheduler's side of structured output: one llguidance matcher per constrained request.

Each step, the matchers of the constrained rows fill one bitmask of the tokens that may come
next (llguidance computes the rows in its own threads, outside the GIL); the sampler keeps
only those tokens. After sampling, each matcher takes its row's token. A matcher lives on its
Req, so a retracted request resumes with its grammar state intact, and every child of n > 1
has its own.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from sluice.grammar import grammar_of, grammar_tokenizer
from sluice.messages import SamplingParams

if TYPE_CHECKING:
    import llguidance

_BIT = torch.arange(32, dtype=torch.int32)


class Grammars:
    def __init__(self, tokenizer_path: str, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        # llguidance's view of the tokenizer takes ~0.5 s to build: in a thread from the
        # start, so the first constrained request does not stall the running ones.
        self._tokenizer = ThreadPoolExecutor(1, thread_name_prefix="grammar-tokenizer").submit(
            _build_tokenizer, tokenizer_path, vocab_size
        )
        self._executor: llguidance.LLExecutor | None = None

    def matcher(self, params: SamplingParams) -> llguidance.LLMatcher | None:
        """A fresh matcher for the request's grammar; None when it has none. The main
        process checked the grammar, so one that fails here is a ValueError."""
        import llguidance

        grammar = grammar_of(params)
        if grammar is None:
            return None
        matcher = llguidance.LLMatcher(self._grammar_tokenizer(), grammar)
        if matcher.is_error():
            raise ValueError(f"the grammar does not compile: {matcher.get_error()}")
        return matcher

    def allowed(self, matchers: list[llguidance.LLMatcher]) -> torch.Tensor:
        """bool [len(matchers), vocab_size]: the tokens each matcher lets come next."""
        import llguidance
        from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask_par

        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        tokenizer = self._grammar_tokenizer()
        mask = allocate_token_bitmask(len(matchers), tokenizer.vocab_size)
        fill_next_token_bitmask_par(self._executor, [(m, row) for row, m in enumerate(matchers)], mask)
        bits = ((mask.unsqueeze(-1) >> _BIT) & 1).bool().view(len(matchers), -1)
        allowed = torch.zeros(len(matchers), self.vocab_size, dtype=torch.bool)
        width = min(self.vocab_size, bits.shape[1])
        allowed[:, :width] = bits[:, :width]
        return allowed

    def _grammar_tokenizer(self) -> llguidance.LLTokenizer:
        return self._tokenizer.result()


def _build_tokenizer(tokenizer_path: str, vocab_size: int) -> llguidance.LLTokenizer:
    from sluice.tokenizer_files import load_tokenizer

    return grammar_tokenizer(load_tokenizer(tokenizer_path), vocab_size)
