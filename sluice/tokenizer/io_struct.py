"""What a client asks for (GenerateReqInput) and how it is checked and normalised."""

from __future__ import annotations

import uuid
from typing import Any, Final

import msgspec

from sluice.messages import RID_SEPARATOR, SamplingParams
from sluice.sampling import MAX_TOP_LOGPROBS, ClientError


class GenerateReqInput(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The body of native /generate (and what the OpenAI routes translate into)."""

    text: str | list[str] | None = None
    # list[int] for one prompt, list[list[int]] for a batch (msgspec takes one list type).
    input_ids: list[int | list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    # One image (base64, data URL or local path) or a list per prompt; for a batch, one
    # entry per prompt.
    image_data: str | list[str | list[str]] | None = None
    rid: str | list[str] | None = None
    stream: bool = False
    # One value for every prompt or, for a batch, one per prompt (as SGLang takes them).
    return_logprob: bool | list[bool] = False
    top_logprobs_num: int | list[int] = 0
    logprob_start_len: int | list[int] = -1
    # Higher runs sooner under --schedule-policy priority (every item of a batch alike).
    priority: int | None = None
    # meta_info gets `timings`: each stage in seconds since the request was received.
    return_timings: bool = False
    # Logprobs name each token's text (SGLang's [logprob, token_id, text]; else the text is null).
    return_text_in_logprobs: bool = False
    # Fields the SGLang Model Gateway adds to every /generate it forwards. `model` names the
    # served model ("unknown" when the gateway's client named none; the route checks it);
    # log_metrics false leaves the request out of /metrics; no_logs changes nothing (prompts
    # are never logged); the others are SGLang outputs sluice does not produce: true is refused.
    model: str | None = None
    log_metrics: bool = True
    no_logs: bool = False
    return_bytes: bool = False
    return_entropy: bool = False
    background: bool = False

    @property
    def is_single(self) -> bool:
        if self.text is not None:
            return isinstance(self.text, str)
        return self.input_ids is None or not self.input_ids or isinstance(self.input_ids[0], int)

    @property
    def batch_size(self) -> int:
        if self.is_single:
            return 1
        return len(self.text) if self.text is not None else len(self.input_ids or [])

    @property
    def prompt_field(self) -> str:
        """The field that holds the prompts, for errors."""
        return "text" if self.text is not None else "input_ids"

    # A single request's fields (the request itself when is_single, or an item()), in the
    # shape normalize() and item() give them.

    @property
    def single_rid(self) -> str:
        if not isinstance(self.rid, str):
            raise TypeError(f"a single request has one rid, not {self.rid!r}")
        return self.rid

    @property
    def single_text(self) -> str | None:
        if isinstance(self.text, list):
            raise TypeError("a single request has one text, not a list")
        return self.text

    @property
    def single_input_ids(self) -> list[int] | None:
        if self.input_ids is None:
            return None
        ids = [token for token in self.input_ids if isinstance(token, int)]
        if len(ids) != len(self.input_ids):
            raise TypeError("a single request has one list of token ids, not a list of lists")
        return ids

    def logprob_params(self, item: int | None = None) -> tuple[bool, int, int]:
        """return_logprob, top_logprobs_num and logprob_start_len of a single request (item
        None) or of item `item` of a batch."""

        def of_item(value: Any) -> Any:
            if not isinstance(value, list):
                return value
            if item is None:
                raise TypeError("a single request has one value of each logprob field, not a list")
            return value[item]

        return of_item(self.return_logprob), of_item(self.top_logprobs_num), of_item(self.logprob_start_len)

    @property
    def single_sampling_params(self) -> dict[str, Any] | None:
        if isinstance(self.sampling_params, list):
            raise TypeError("a single request has one sampling_params object, not a list")
        return self.sampling_params

    def sample_count(self) -> int:
        """`n` of the request: one value for every item, or a ClientError."""
        params = self.sampling_params if isinstance(self.sampling_params, list) else [self.sampling_params or {}]
        # null is the default, as for every sampling parameter.
        counts = [_n_of(p) for p in params]
        for n in counts:
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise ClientError(f"n must be an integer >= 1, got {n!r}", "n")
        if len(set(counts)) > 1:
            raise ClientError(f"every item must have the same n, got {sorted(set(counts))}", "n")
        return counts[0] if counts else 1

    def image_refs(self) -> list[str]:
        """The images of a single request, as a list."""
        if self.image_data is None:
            return []
        if isinstance(self.image_data, str):
            return [self.image_data]
        refs = [ref for ref in self.image_data if isinstance(ref, str)]
        if len(refs) != len(self.image_data):
            raise ClientError("'image_data' must be a string or a list of strings for one prompt", "image_data")
        return refs

    def normalize_batch(self, max_items: int) -> None:
        """Check a list request's shape, cheaply, before any per-item work."""
        size = self.batch_size
        if size == 0:
            raise ClientError("the list of prompts is empty", self.prompt_field)
        if self.image_data is not None and (not isinstance(self.image_data, list) or len(self.image_data) != size):
            raise ClientError(f"'image_data' must have one entry per prompt ({size})", "image_data")
        if size > max_items:
            raise ClientError(f"the request has {size} items, more than max_batch_items={max_items}", self.prompt_field)
        if isinstance(self.sampling_params, list) and len(self.sampling_params) != size:
            raise ClientError(
                f"'sampling_params' has {len(self.sampling_params)} entries for {size} prompts", "sampling_params"
            )
        if isinstance(self.rid, list):
            if len(self.rid) != size:
                raise ClientError(f"'rid' has {len(self.rid)} entries for {size} prompts", "rid")
            if len(set(self.rid)) != size or not all(self.rid):
                raise ClientError("the rids of a batch must be distinct and non-empty", "rid")
            check_client_rids(self.rid)
        elif self.rid is not None:
            raise ClientError("'rid' must be a list with one rid per prompt", "rid")
        else:
            self.rid = [uuid.uuid4().hex for _ in range(size)]

    def item(self, i: int) -> GenerateReqInput:
        """Item i of a list request, as a single request."""
        params = self.sampling_params[i] if isinstance(self.sampling_params, list) else self.sampling_params
        if not isinstance(self.rid, list):
            raise TypeError("normalize_batch() gives every item of a list request a rid")
        # Copies typed as the fields are (msgspec takes one list type: see input_ids).
        input_ids: list[int | list[int]] | None = None
        if self.input_ids is not None:
            ids = self.input_ids[i]
            if isinstance(ids, int):
                raise TypeError("the items of a list request are lists of token ids")
            input_ids = [*ids]
        image_data = self.image_data
        if isinstance(image_data, list):
            image = image_data[i]
            image_data = image if isinstance(image, str) else [*image]
        return_logprob, top_logprobs_num, logprob_start_len = self.logprob_params(i)
        return GenerateReqInput(
            text=self.text[i] if self.text is not None else None,
            input_ids=input_ids,
            sampling_params=params,
            image_data=image_data,
            rid=self.rid[i],
            stream=self.stream,
            return_logprob=return_logprob,
            top_logprobs_num=top_logprobs_num,
            logprob_start_len=logprob_start_len,
            return_text_in_logprobs=self.return_text_in_logprobs,
            priority=self.priority,
            return_timings=self.return_timings,
        )

    def normalize(self) -> None:
        """Check the shape of the request and fill in a rid."""
        if (self.text is None) == (self.input_ids is None):
            raise ClientError("exactly one of 'text' and 'input_ids' must be given", "text")
        if self.input_ids is not None:
            kinds = {type(item) for item in self.input_ids}
            if len(kinds) > 1:
                raise ClientError("'input_ids' must be a list of token ids or a list of such lists", "input_ids")
        if self.is_single:
            if isinstance(self.rid, list):
                raise ClientError("'rid' must be a string for a single prompt", "rid")
            if isinstance(self.sampling_params, list):
                raise ClientError("'sampling_params' must be an object for a single prompt", "sampling_params")
            if self.rid is None:
                self.rid = uuid.uuid4().hex
            elif not self.rid:
                raise ClientError("'rid' must not be empty", "rid")
            check_client_rids([self.rid])
        check_priority(self.priority)
        for unsupported in ("return_bytes", "return_entropy", "background"):
            if getattr(self, unsupported):
                raise ClientError(f"{unsupported}: true is not supported (only false)", unsupported)
        self._check_logprob_params()

    def _check_logprob_params(self) -> None:
        size = self.batch_size
        for name in ("return_logprob", "top_logprobs_num", "logprob_start_len"):
            value = getattr(self, name)
            if isinstance(value, list) and self.is_single:
                raise ClientError(f"'{name}' must be one value for a single prompt, not a list", name)
            if isinstance(value, list) and len(value) != size:
                raise ClientError(f"'{name}' has {len(value)} entries for {size} prompts", name)
        items: list[int | None] = [None] if self.is_single else list(range(size))
        options = [self.logprob_params(item) for item in items]
        any_logprobs = any(return_logprob for return_logprob, _, _ in options)
        for item, (return_logprob, top_logprobs_num, logprob_start_len) in zip(items, options, strict=True):
            where = "" if item is None else f"item {item}: "
            if top_logprobs_num < 0:
                raise ClientError(f"{where}top_logprobs_num must be >= 0, got {top_logprobs_num}", "top_logprobs_num")
            if top_logprobs_num > MAX_TOP_LOGPROBS:
                raise ClientError(
                    f"{where}top_logprobs_num must be <= {MAX_TOP_LOGPROBS}, got {top_logprobs_num}",
                    "top_logprobs_num",
                )
            if logprob_start_len < -1:
                raise ClientError(
                    f"{where}logprob_start_len must be >= -1, got {logprob_start_len}", "logprob_start_len"
                )
            # Each would change the answer's logprobs, of which there are none without it: a
            # value of the item's own, or one for every item where no item has logprobs.
            for name, value, default in (
                ("top_logprobs_num", top_logprobs_num, 0),
                ("logprob_start_len", logprob_start_len, -1),
            ):
                own = isinstance(getattr(self, name), list)
                if value != default and not return_logprob and (own or not any_logprobs):
                    raise ClientError(f"{where if own else ''}{name} needs return_logprob: true", name)
        if self.return_text_in_logprobs and not any_logprobs:
            raise ClientError("return_text_in_logprobs needs return_logprob: true", "return_text_in_logprobs")


class EmbeddingReqInput(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The body of native /encode (and what /v1/embeddings translates into): one prompt or
    a list, as text or token ids; each is answered with its pooled final hidden state."""

    text: str | list[str] | None = None
    input_ids: list[int | list[int]] | None = None
    rid: str | list[str] | None = None
    priority: int | None = None

    @property
    def is_single(self) -> bool:
        if self.text is not None:
            return isinstance(self.text, str)
        return not self.input_ids or isinstance(self.input_ids[0], int)

    @property
    def prompt_field(self) -> str:
        """The field that holds the prompts, for errors."""
        return "text" if self.text is not None else "input_ids"

    def prompts(self, max_items: int) -> list[str] | list[list[int]]:
        """Every prompt, checked for shape (a single prompt is a list of one); fills in rids."""
        if (self.text is None) == (self.input_ids is None):
            raise ClientError("exactly one of 'text' and 'input_ids' must be given", "text")
        prompts: list[str] | list[list[int]]
        if isinstance(self.text, str):
            prompts = [self.text]
        elif self.text is not None:
            prompts = self.text
        else:
            ids = self.input_ids or []
            if all(isinstance(token, int) for token in ids) and ids:
                prompts = [[token for token in ids if isinstance(token, int)]]
            elif all(isinstance(item, list) for item in ids) and ids:
                prompts = [item for item in ids if isinstance(item, list)]
            else:
                raise ClientError("'input_ids' must be a non-empty list of token ids or of such lists", "input_ids")
        field = self.prompt_field
        if not prompts:
            raise ClientError(f"'{field}' is an empty list", field)
        if len(prompts) > max_items:
            raise ClientError(f"the request has {len(prompts)} items, more than max_batch_items={max_items}", field)
        check_priority(self.priority)
        self._fill_rids(len(prompts))
        return prompts

    def _fill_rids(self, count: int) -> None:
        if self.is_single:
            if self.rid is None:
                self.rid = uuid.uuid4().hex
            elif not isinstance(self.rid, str) or not self.rid:
                raise ClientError("'rid' must be a non-empty string for a single prompt", "rid")
        elif self.rid is None:
            self.rid = [uuid.uuid4().hex for _ in range(count)]
        elif (
            not isinstance(self.rid, list) or len(self.rid) != count or len(set(self.rid)) != count or not all(self.rid)
        ):
            raise ClientError(f"'rid' must be a list of {count} distinct non-empty rids, one per prompt", "rid")
        check_client_rids(self.rids)

    @property
    def rids(self) -> list[str]:
        return [self.rid] if isinstance(self.rid, str) else list(self.rid or [])


def check_client_rids(rids: list[str]) -> None:
    """A client's rid may not hold "::": the server names a request's samples and prompt
    warm-up rid::i and rid::prefix, and an abort of rid ends them all."""
    if any(RID_SEPARATOR in rid for rid in rids):
        raise ClientError(f"'rid' may not contain {RID_SEPARATOR!r}: the server names a request's samples so", "rid")


MAX_PRIORITY: Final = 2**63 - 1  # what the messages to the Scheduler carry (a signed 64-bit integer)


def check_priority(priority: int | None) -> None:
    if priority is not None and not 0 <= priority <= MAX_PRIORITY:
        raise ClientError(f"priority must be an integer in [0, 2**63) (higher runs sooner), got {priority}", "priority")


def _n_of(params: Any) -> Any:
    n = params.get("n") if isinstance(params, dict) else None
    return 1 if n is None else n


def parse_sampling_params(raw: dict[str, Any] | None) -> SamplingParams:
    """Build SamplingParams from a client's dict; wrong types and unknown keys (none may be
    silently ignored) are a ClientError."""
    raw = dict(raw or {})
    raw.pop("n", None)  # expanded by the TokenizerManager, never sent on
    if "sampling_seed" in raw:  # SGLang's name of seed
        seed = raw.pop("sampling_seed")
        if raw.get("seed") is not None and seed is not None and raw["seed"] != seed:
            raise ClientError("sampling_seed is SGLang's name of seed: give one", "sampling_params.sampling_seed")
        if seed is not None:
            raw["seed"] = seed
    unknown = sorted(set(raw) - set(SamplingParams.__struct_fields__))
    if unknown:
        raise ClientError(
            f"sampling_params.{unknown[0]} is not supported by this server; leave it out",
            f"sampling_params.{unknown[0]}",
        )
    # null is the parameter's default, for every one of them (max_new_tokens: see
    # RequestTokenizer, which gives it the room the context leaves).
    raw = {key: value for key, value in raw.items() if value is not None}
    if isinstance(raw.get("stop"), str):
        raw["stop"] = [raw["stop"]]
    if isinstance(raw.get("logit_bias"), dict):
        raw["logit_bias"] = _token_id_keys(raw["logit_bias"])
    try:
        return msgspec.convert(raw, SamplingParams)
    except msgspec.ValidationError as e:
        raise ClientError(f"invalid sampling_params: {e}", "sampling_params") from None


def _token_id_keys(logit_bias: dict[Any, Any]) -> dict[int, Any]:
    """OpenAI sends logit_bias keyed by token ids written as strings ("15"): in decimal digits,
    without sign, spaces or leading zeros, so that no two keys name one token (int() would
    take "015", " 15", "+15", "1_5" and other scripts' digits too, the last key silently
    overriding the others)."""
    keyed = {}
    for key, bias in logit_bias.items():
        if isinstance(key, int) and not isinstance(key, bool):  # the Engine's callers may key by ints
            keyed[key] = bias
            continue
        canonical = isinstance(key, str) and key.isascii() and key.isdigit() and (key == "0" or key[0] != "0")
        if not canonical or len(key) > 18:  # past 18 digits no id of any vocabulary (nor int64)
            shown = key if not isinstance(key, str) or len(key) <= 40 else f"{key[:40]}..."
            raise ClientError(
                f"logit_bias keys must be token ids written in decimal digits, got {shown!r}", "logit_bias"
            )
        keyed[int(key)] = bias
    return keyed
