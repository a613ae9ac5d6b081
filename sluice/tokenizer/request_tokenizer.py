"""From a client's prompts to the Scheduler's input: images, token ids, and every check
against the model's limits. Used by the single path and the batch path alike."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Container, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from sluice.config import ServerArgs
from sluice.grammar import check_grammar, grammar_compiler, grammar_key, start_grammar_tokenizer
from sluice.messages import (
    ImageInput,
    SamplingParams,
    SchedulerReady,
    TokenizedEmbeddingReqInput,
    TokenizedGenerateReqInput,
)
from sluice.sampling import ClientError, validate_sampling_params
from sluice.tokenizer.admission import check_fits_in_queue, check_fits_in_token_queue
from sluice.tokenizer.io_struct import EmbeddingReqInput, GenerateReqInput, parse_sampling_params
from sluice.tokenizer.multimodal.request_images import RequestImages

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

CHECKED_GRAMMARS_KEPT = 256
# Tokenizing takes about 2 us a character: texts longer than this (together) are tokenized on
# a thread, off the event loop (16 MB of text took 30 s).
LONG_TEXT_CHARS = 32_768
# A text whose first characters already make more tokens than the limit plus this is refused
# without the rest being tokenized (the tokens near the cut may differ from the whole text's).
CUT_MARGIN_TOKENS = 16


class RequestTokenizer:
    def __init__(self, server_args: ServerArgs, tokenizer: PreTrainedTokenizerBase) -> None:
        self.server_args = server_args
        self.tokenizer = tokenizer
        self.mm_processor: RequestImages | None = None  # a vision-language model's image pipeline
        self.scheduler_info: SchedulerReady | None = None  # the model's limits, once the back end is ready
        # llguidance's view of the tokenizer (~0.5 s to build), for checking grammars: built
        # in a thread from the start, off the event loop.
        self._grammar_tokenizer: Future[Any] | None = None
        self._grammar_checker: ThreadPoolExecutor | None = None  # started with the first grammar
        # Grammar texts checked, by field:text: None where it compiles, else its refusal.
        self._checked_grammars: OrderedDict[str, tuple[str, str | None] | None] = OrderedDict()
        self._longest_token: int | None = None  # characters of the longest token's text, once asked
        if tokenizer is not None:  # unit tests may run without one
            self._grammar_tokenizer = start_grammar_tokenizer(tokenizer, len(tokenizer))
            # A tokenizer.json may ship truncation or padding, which transformers switches off
            # in the Rust tokenizer at a call: off once here, so that the event loop and a
            # thread (long prompts) can tokenize at once without either changing it under the
            # other ("Already borrowed").
            if (backend := getattr(tokenizer, "_tokenizer", None)) is not None:
                backend.no_truncation()
                backend.no_padding()

    async def tokenize(
        self,
        items: list[GenerateReqInput],
        live_rids: Container[str],
        label_items: bool = False,
        received_at: float = 0.0,
    ) -> list[TokenizedGenerateReqInput]:
        """Tokenize and check every item; the first bad one fails them all (a ClientError
        that names the item when `label_items`). `received_at`: when the request came in."""

        async def images_of(i: int, item: GenerateReqInput) -> list[ImageInput]:
            with naming_the_item(i if label_items else None):
                return await self._process_images(item)

        images = await asyncio.gather(*(images_of(i, item) for i, item in enumerate(items)))
        texts = [
            self._text_with_placeholders(item.single_text or "", len(imgs))
            for item, imgs in zip(items, images, strict=True)
            if item.input_ids is None
        ]
        encoded = iter(await self.encode(texts))
        tokenized: list[TokenizedGenerateReqInput] = []
        for i, (item, item_images) in enumerate(zip(items, images, strict=True)):
            given_ids = item.single_input_ids
            with naming_the_item(i if label_items else None):
                ids = given_ids if given_ids is not None else self.whole(next(encoded), "text")
                tokenized.append(self._tokenized(item, ids, item_images, received_at))
                await self._check_grammar(tokenized[-1].sampling_params)
        # The rids last, with no await between here and the caller's add_req_state: a rid
        # found free stays free until its state takes it.
        seen: set[str] = set()
        for i, t in enumerate(tokenized):
            with naming_the_item(i if label_items else None):
                if t.rid in seen or t.rid in live_rids:
                    raise ClientError(f"a request with rid '{t.rid}' is already running", "rid")
                seen.add(t.rid)
        return tokenized

    async def encode(
        self, texts: list[str], add_special_tokens: bool = True, limit: int | None = None
    ) -> list[list[int] | int]:
        """Each text's token ids, in one tokenizer call (the fast tokenizer encodes a list in
        parallel Rust). Long texts are tokenized on a thread, and one that holds more than
        `limit` tokens (max_req_input_len unless given) within its first characters is
        not tokenized further: in its place is the number of tokens it has at least (see
        `whole`)."""
        if sum(map(len, texts)) <= LONG_TEXT_CHARS:
            return list(self.tokenizer(texts, add_special_tokens=add_special_tokens).input_ids) if texts else []
        return await asyncio.to_thread(self._encode_long, texts, add_special_tokens, limit)

    def _encode_long(self, texts: list[str], add_special_tokens: bool, limit: int | None) -> list[list[int] | int]:
        limit = self._limits().max_req_input_len if limit is None else limit
        # No token covers more characters than its text in the vocabulary has.
        cut = self._longest_token_chars() * (limit + CUT_MARGIN_TOKENS)
        at_least: dict[int, int] = {}
        for i, text in enumerate(texts):
            if len(text) > cut:
                count = len(self.tokenizer(text[:cut], add_special_tokens=add_special_tokens).input_ids)
                if count > limit + CUT_MARGIN_TOKENS:
                    at_least[i] = count - CUT_MARGIN_TOKENS
        whole = [text for i, text in enumerate(texts) if i not in at_least]
        encoded = iter(self.tokenizer(whole, add_special_tokens=add_special_tokens).input_ids if whole else [])
        return [at_least[i] if i in at_least else next(encoded) for i in range(len(texts))]

    def _longest_token_chars(self) -> int:
        if self._longest_token is None:
            self._longest_token = max(map(len, self.tokenizer.get_vocab()))
        return self._longest_token

    def whole(self, encoded: list[int] | int, given_as: str, limit: int | None = None) -> list[int]:
        """A text's token ids from `encode`; a ClientError naming `given_as` for one cut short."""
        if isinstance(encoded, int):
            limit = self._limits().max_req_input_len if limit is None else limit
            raise ClientError(
                f"The input has at least {encoded:,} tokens, more than the maximum input length "
                f"max_req_input_len={limit}",
                given_as,
            )
        return encoded

    def can_send_as_one_batch(self, items: list[GenerateReqInput]) -> bool:
        # Items that carry images are sent one by one: each has its own pixel payload and
        # expansion in the Scheduler, and a mixed batch must not hold text items back behind
        # image work. A slow (Python) tokenizer gains nothing from one call either.
        return getattr(self.tokenizer, "is_fast", False) and not any(item.image_data for item in items)

    async def _process_images(self, obj: GenerateReqInput) -> list[ImageInput]:
        """Load and preprocess a request's images off the event loop (before tokenization)."""
        refs = obj.image_refs()
        if not refs:
            return []
        return await self._images().process(refs)

    def _images(self) -> RequestImages:
        if self.mm_processor is None:
            raise ClientError(f"the model {self.server_args.model_name()} does not accept images", "image_data")
        return self.mm_processor

    def _token_id_bound(self) -> int:
        """Token ids a request may name (prompt, stop_token_ids, logit_bias) lie below this:
        both the tokenizer and the model must have them (a tokenizer may list added tokens
        past the model's logits)."""
        return min(len(self.tokenizer), self._limits().vocab_size)

    def _limits(self) -> SchedulerReady:
        if self.scheduler_info is None:
            raise RuntimeError("the back end has not reported the model's limits yet")
        return self.scheduler_info

    def expanded_length(self, input_ids: list[int], num_images: int) -> int:
        """A prompt's length with each of its images' tokens expanded to num_image_tokens."""
        return len(input_ids) + (num_images * (self._limits().num_image_tokens - 1) if num_images else 0)

    def _text_with_placeholders(self, text: str, num_images: int) -> str:
        return self._images().prompt_with_placeholders(text, num_images) if num_images else text

    def _tokenized(
        self, obj: GenerateReqInput, input_ids: list[int], images: list[ImageInput], received_at: float
    ) -> TokenizedGenerateReqInput:
        if images or self.mm_processor is not None:  # an image token needs its image too
            self._images().check_tokens(input_ids, len(images))
        raw_params = obj.single_sampling_params or {}
        params = parse_sampling_params(raw_params)
        # The prompt as the Scheduler runs it, each image token expanded: its length is the
        # one that meets the context and that logprob positions count in (as prompt_tokens).
        num_input = self.expanded_length(input_ids, len(images))
        if raw_params.get("max_new_tokens") is None:
            # As SGLang: null runs up to the context, and the default (left out) is cut to
            # the room the context leaves; only a limit the client gave is refused past it.
            room = max(self._limits().context_len - num_input, 0)
            params.max_new_tokens = room if "max_new_tokens" in raw_params else min(params.max_new_tokens, room)
        self._check_lengths(input_ids, num_input, params, obj.prompt_field)
        self._check_params(params)
        return_logprob, top_logprobs_num, logprob_start_len = obj.logprob_params()
        if return_logprob and logprob_start_len > num_input:
            raise ClientError(
                f"logprob_start_len {logprob_start_len} is past the prompt's {num_input} tokens", "logprob_start_len"
            )
        if logprob_start_len == num_input:
            logprob_start_len = -1  # from the prompt's end: none of it
        return TokenizedGenerateReqInput(
            rid=obj.single_rid,
            input_ids=input_ids,
            sampling_params=params,
            stream=obj.stream,
            return_logprob=return_logprob,
            top_logprobs_num=top_logprobs_num if return_logprob else 0,
            logprob_start_len=logprob_start_len if return_logprob else -1,
            input_text=obj.text if isinstance(obj.text, str) else "",
            images=list(images),
            priority=self._priority(obj.priority),
            received_at=received_at,
            return_timings=obj.return_timings,
        )

    async def check_sampling_params(self, obj: GenerateReqInput) -> None:
        """Every item's sampling_params, with the checks that need no tokens (tokenizing
        runs them again, with the rest): for a request about to wait at the gate, so a bad
        one is refused at once, not once the pause or weight update is over."""
        given = obj.sampling_params if isinstance(obj.sampling_params, list) else [obj.sampling_params]
        for i, raw in enumerate(given):
            with naming_the_item(i if len(given) > 1 else None):
                params = parse_sampling_params(raw)
                self._check_params(params)
                await self._check_grammar(params)

    def _check_params(self, params: SamplingParams) -> None:
        validate_sampling_params(params, self._token_id_bound())

    async def _check_grammar(self, params: SamplingParams) -> None:
        """A ClientError naming the field when the request's grammar does not compile. The
        compile runs on a thread of its own (grammar_compiler), off the event loop, once per
        grammar text: the verdicts of the last CHECKED_GRAMMARS_KEPT are kept (the items of
        a batch, a request checked at the pause gate and again after, clients that send the
        same schema)."""
        key = grammar_key(params)
        if key is None or self._grammar_tokenizer is None:
            return
        if key in self._checked_grammars:
            self._checked_grammars.move_to_end(key)
        else:
            tokenizer = await asyncio.wrap_future(self._grammar_tokenizer)
            if self._grammar_checker is None:
                self._grammar_checker = grammar_compiler("grammar-check")
            check = self._grammar_checker.submit(check_grammar, params, tokenizer, self.server_args.reasoning_parser)
            try:
                await asyncio.wrap_future(check)
                self._checked_grammars[key] = None
            except ClientError as e:
                self._checked_grammars[key] = (e.message, e.param)
            while len(self._checked_grammars) > CHECKED_GRAMMARS_KEPT:
                self._checked_grammars.popitem(last=False)
        if (refusal := self._checked_grammars[key]) is not None:
            raise ClientError(*refusal)

    def _priority(self, priority: int | None) -> int:
        if priority and self.server_args.schedule_policy != "priority":
            raise ClientError(
                f"priority {priority} has no effect: this server schedules by {self.server_args.schedule_policy} "
                "(start it with --schedule-policy priority)",
                "priority",
            )
        return priority or 0

    async def tokenize_embeddings(
        self, obj: EmbeddingReqInput, live_rids: Container[str], received_at: float
    ) -> list[TokenizedEmbeddingReqInput]:
        """Every prompt of an embedding request, tokenized in one call and checked; the first
        bad one fails them all (a ClientError naming the item of a list)."""
        prompts = obj.prompts(self.server_args.max_batch_items)
        field = obj.prompt_field
        check_fits_in_queue(len(prompts), self.server_args, field, f"the request has {len(prompts)} items")
        texts = [prompt for prompt in prompts if isinstance(prompt, str)]
        encoded = await self.encode(texts)
        all_ids = encoded if texts else [prompt for prompt in prompts if isinstance(prompt, list)]
        priority = self._priority(obj.priority)
        tokenized = []
        for i, (rid, given) in enumerate(zip(obj.rids, all_ids, strict=True)):
            with naming_the_item(None if obj.is_single else i):
                if rid in live_rids:
                    raise ClientError(f"a request with rid '{rid}' is already running", "rid")
                ids = self.whole(given, "text")
                self._check_prompt(ids, "text" if texts else "input_ids")
            tokenized.append(
                TokenizedEmbeddingReqInput(rid=rid, input_ids=ids, priority=priority, received_at=received_at)
            )
        check_fits_in_token_queue([len(t.input_ids) for t in tokenized], self.server_args, field, len(tokenized) == 1)
        return tokenized

    def _check_prompt(self, input_ids: list[int], given_as: str) -> None:
        """A prompt the model can take: not empty, known token ids, within max_req_input_len.
        given_as: the request field that held it ("text" or "input_ids"), for errors."""
        num_input = len(input_ids)
        if num_input == 0:
            raise ClientError("the prompt is empty", given_as)
        vocab = self._token_id_bound()
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in input_ids):
            raise ClientError(f"input_ids must be token ids in [0, {vocab})", "input_ids")
        max_input = self._limits().max_req_input_len
        if num_input > max_input:
            raise ClientError(
                f"The input has {num_input} tokens, more than the maximum input length max_req_input_len={max_input}",
                given_as,
            )

    def _check_lengths(self, input_ids: list[int], num_input: int, params: SamplingParams, given_as: str) -> None:
        """num_input: the prompt's length as the Scheduler runs it (image tokens expanded).
        A prompt too long once expanded is the Scheduler's to refuse (its own message)."""
        self._check_prompt(input_ids, given_as)
        limits = self._limits()
        context_len = limits.context_len
        if num_input <= limits.max_req_input_len and num_input + params.max_new_tokens > context_len:
            raise ClientError(
                f"The input has {num_input} tokens and max_new_tokens is {params.max_new_tokens}: "
                f"together {num_input + params.max_new_tokens}, more than the context length {context_len}",
                "max_new_tokens",
            )


@contextmanager
def naming_the_item(index: int | None) -> Iterator[None]:
    """A ClientError raised inside names item `index` of a list request (None: a single one)."""
    try:
        yield
    except ClientError as e:
        if index is None:
            raise
        raise ClientError(f"item {index}: {e.message}", e.param) from None
