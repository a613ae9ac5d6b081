"""The Scheduler's side of structured output: one llguidance matcher per constrained request.

A new grammar compiles in a thread while its request waits (scheduler.py keeps such
requests aside, so the running ones never stall on it), first mask included (llguidance
builds its lexer lazily); compiled grammars are kept by their text, and each request gets
a copy of the compiled matcher. Each step, the matchers of the constrained rows fill one
bitmask of the tokens that may come next (llguidance computes the rows in its own threads,
outside the GIL); the sampler keeps only those tokens. After sampling, each matcher takes
its row's token. A matcher lives on its Req, so a retracted request resumes with its
grammar state intact, and every child of n > 1 has its own.
"""

from __future__ import annotations

from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Final

import torch

from sluice.grammar import grammar_compiler, grammar_key, grammar_of, grammar_tokenizer, parser_limits
from sluice.messages import SamplingParams

if TYPE_CHECKING:
    import llguidance

_BIT = torch.arange(32, dtype=torch.int32)
COMPILED_GRAMMARS_KEPT: Final = 256


class Grammars:
    def __init__(self, tokenizer_path: str, vocab_size: int, reasoning_parser: str = "none") -> None:
        self.vocab_size = vocab_size
        self.reasoning_parser = reasoning_parser
        self.tokenizer_path = tokenizer_path
        # llguidance's view of the tokenizer takes seconds to build (transformers is imported
        # for it, ~120 MB this process would otherwise never hold): in a thread, once the
        # first constrained request comes, so that request waits and the running ones do not.
        self._tokenizer_builder = ThreadPoolExecutor(1, thread_name_prefix="grammar-tokenizer")
        self._tokenizer: Future[llguidance.LLTokenizer] | None = None
        self._executor: llguidance.LLExecutor | None = None
        self._compiler: ThreadPoolExecutor | None = None  # started with the first grammar
        self._compiled: OrderedDict[str, Future[llguidance.LLMatcher]] = OrderedDict()

    def compile(self, params: SamplingParams) -> Future[llguidance.LLMatcher] | None:
        """The request's grammar compiling (or compiled) in the background, its conversion
        to llguidance's form included (GBNF's takes seconds for thousands of rules: not on
        the Scheduler's loop); None when it has none. Raises ClientError for a request with
        two grammar fields (the main process checked it already)."""
        key = grammar_key(params)
        if key is None:
            return None
        if self._tokenizer is None:
            self._tokenizer = self._tokenizer_builder.submit(_build_tokenizer, self.tokenizer_path, self.vocab_size)
        compiled = self._compiled.pop(key, None)
        if compiled is None:
            if self._compiler is None:
                self._compiler = grammar_compiler("grammar-compiler")
            compiled = self._compiler.submit(self._compile, params)
        self._compiled[key] = compiled  # the most recently used last
        while len(self._compiled) > COMPILED_GRAMMARS_KEPT:
            self._compiled.popitem(last=False)
        return compiled

    def cancel(self, compiled: Future[llguidance.LLMatcher]) -> None:
        """Drop a compilation no request waits for, if it has not started (aborted requests
        would otherwise leave a queue of them in front of the next grammar)."""
        if compiled.cancel():
            self._forget(compiled)

    def _forget(self, compiled: Future[llguidance.LLMatcher]) -> None:
        for grammar in [text for text, future in self._compiled.items() if future is compiled]:
            del self._compiled[grammar]

    def matcher(self, compiled: Future[llguidance.LLMatcher]) -> llguidance.LLMatcher:
        """A request's own matcher from its compiled grammar (which stays untouched);
        ValueError when the grammar failed to compile. Any other error is the compiler's
        (the grammar tokenizer could not be built, say): it is not kept, so the next request
        with that grammar tries again."""
        try:
            return compiled.result().deep_copy()
        except ValueError:
            raise
        except Exception:
            self._forget(compiled)
            if self._tokenizer is not None and self._tokenizer.done() and self._tokenizer.exception() is not None:
                self._tokenizer = None
            raise

    def _compile(self, params: SamplingParams) -> llguidance.LLMatcher:
        import llguidance
        from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask

        grammar = grammar_of(params, self.reasoning_parser)
        assert grammar is not None, "compile() sends only requests with a grammar"
        tokenizer = self._grammar_tokenizer()
        # Silent: errors are read with get_error(); the thinking's stop string would warn on
        # every request that it cannot be taken back (sluice keeps it in the answer).
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=parser_limits())
        if matcher.is_error():
            raise ValueError(f"the grammar does not compile: {matcher.get_error()}")
        fill_next_token_bitmask(matcher.deep_copy(), allocate_token_bitmask(1, tokenizer.vocab_size), 0)
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
        assert self._tokenizer is not None, "a grammar was compiled first"
        return self._tokenizer.result()


def take_token(matcher: llguidance.LLMatcher, token: int) -> str | None:
    """Advance a request's matcher by its sampled token; what went wrong where the grammar
    reached a dead end (sampling kept to the mask, so that is the grammar's own)."""
    # A matcher in error (one that could not compute a mask, say) reports itself stopped
    # too, and lets only EOS through: that is no complete answer.
    if matcher.is_stopped() and not matcher.is_error():
        return None  # an EOS after the end (ignore_eos): nothing left to match
    if matcher.is_error() or not matcher.consume_token(token) or matcher.is_error():
        return f"the grammar reached a dead end: {matcher.get_error() or 'no token fits'}"
    return None


def _build_tokenizer(tokenizer_path: str, vocab_size: int) -> llguidance.LLTokenizer:
    from sluice.tokenizer_files import load_tokenizer

    return grammar_tokenizer(load_tokenizer(tokenizer_path), vocab_size)
