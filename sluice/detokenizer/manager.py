"""The DetokenizerManager process: token ids in, text out, stop strings applied.

Stop strings are text, so they are matched here. When one matches, the request's text is
final: the detokenizer sends the final chunk at once and tells the scheduler to release
the request (AbortReq with finished_by_stop_string). Outputs the scheduler produced before
it heard of the stop are dropped, up to and including its own final one.
"""

from __future__ import annotations

import logging
import sys
import traceback
from typing import TYPE_CHECKING

import msgspec
import zmq

from sluice.config import PortArgs, ServerArgs
from sluice.detokenizer.decoding_tokenizer import DecodingTokenizer, load_decoding_tokenizer
from sluice.detokenizer.incremental import IncrementalDetokenizer
from sluice.ipc import LAST_WORDS_MS, Receiver, Sender
from sluice.messages import (
    AbortReq,
    BatchEmbeddingOutput,
    BatchStrOutput,
    BatchTokenIDOutput,
    DetokenizerReady,
    FinishReason,
    ProcessFailed,
    StrOutput,
    TokenIDOutput,
)
from sluice.procutil import become_child_process
from sluice.tokenizer_files import TokenizerUnreadable, keep_torch_out_where_the_tokenizer_allows

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


class DetokenizerManager:
    def __init__(self, tokenizer: DecodingTokenizer | PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.decoders: dict[str, IncrementalDetokenizer] = {}
        # Requests finished by a stop string whose final scheduler output has not come yet.
        self.stopped_rids: set[str] = set()

    def handle(self, batch: BatchTokenIDOutput) -> tuple[list[StrOutput], list[str]]:
        """Returns the text outputs and the rids the scheduler must release."""
        outputs: list[StrOutput] = []
        to_release: list[str] = []
        for out in batch.outputs:
            rid = out.output.rid
            if rid in self.stopped_rids:
                if out.output.finish_reason is not None:
                    self.stopped_rids.discard(rid)
                continue
            text_out = self._detokenize(out)
            if text_out.output.finish_reason is not None and out.output.finish_reason is None:
                self.stopped_rids.add(rid)
                to_release.append(rid)
            outputs.append(text_out)
        return outputs, to_release

    def _detokenize(self, out: TokenIDOutput) -> StrOutput:
        output = out.output
        decoder = self.decoders.get(output.rid)
        if decoder is None:
            decoder = IncrementalDetokenizer(
                self.tokenizer,
                skip_special_tokens=out.skip_special_tokens,
                spaces_between_special_tokens=out.spaces_between_special_tokens,
                stop=out.stop,
                min_new_tokens=out.min_new_tokens,
                no_stop_trim=out.no_stop_trim,
                stream=out.stream,
                prompt_tail=out.prompt_tail,
            )
            self.decoders[output.rid] = decoder
        step = decoder.step(_answer_ids(out), output.finish_reason is not None)
        if step.stop_matched is not None:
            # The text ends at the stop string: the request is finished, with the tokens it covers.
            output = msgspec.structs.replace(
                output,
                finish_reason=FinishReason(type="stop", matched=step.stop_matched),
                completion_tokens=step.num_tokens,
            )
        if output.finish_reason is not None:
            del self.decoders[output.rid]
        return StrOutput(output=output, text=step.text, continues_prompt=decoder.continues_prompt)


def _answer_ids(out: TokenIDOutput) -> list[int]:
    """The new ids whose text is the answer's: a stop token (EOS or one of stop_token_ids)
    that ended it is not, unless no_stop_trim, as SGLang and vLLM trim it. It stays in
    output_ids and counts in completion_tokens."""
    ids, reason = out.output.new_token_ids, out.output.finish_reason
    if (
        reason is None
        or out.no_stop_trim
        or not isinstance(reason.matched, int)
        or not ids
        or ids[-1] != reason.matched
    ):
        return ids
    return ids[:-1]


def run_detokenizer_process(server_args_data: bytes, port_args_data: bytes) -> None:
    args = ServerArgs.decode(server_args_data)
    port_args = PortArgs.decode(port_args_data)
    become_child_process("detokenizer", args.log_level)
    keep_torch_out_where_the_tokenizer_allows(args.resolved_model_path())  # it loads the tokenizer alone
    context = zmq.Context(1)
    to_tokenizer = Sender(context, port_args.tokenizer_input)
    try:
        manager = DetokenizerManager(load_decoding_tokenizer(args.resolved_model_path()))
        inbox = Receiver(context, port_args.detokenizer_input)
        to_scheduler = Sender(context, port_args.scheduler_input)
        to_tokenizer.send(DetokenizerReady())
        while True:
            message = inbox.recv()
            if isinstance(message, BatchEmbeddingOutput):
                to_tokenizer.send(message)  # no text to make: on in order with the rest
                continue
            if not isinstance(message, BatchTokenIDOutput):
                logger.warning("detokenizer ignored an unexpected %s", type(message).__name__)
                continue
            outputs, to_release = manager.handle(message)
            for rid in to_release:
                to_scheduler.send(AbortReq(rid=rid, finished_by_stop_string=True))
            # An empty batch is the scheduler's heartbeat: pass it on for the watchdog.
            to_tokenizer.send(BatchStrOutput(outputs=outputs))
    except TokenizerUnreadable as e:
        # The front end finds and says the same, in one line: no traceback here either.
        to_tokenizer.send(ProcessFailed(process="detokenizer", error=str(e)))
        to_tokenizer.close(linger_ms=LAST_WORDS_MS)
        sys.exit(1)
    except Exception:
        error = traceback.format_exc()
        logger.error("detokenizer failed:\n%s", error)
        to_tokenizer.send(ProcessFailed(process="detokenizer", error=error))
        to_tokenizer.close(linger_ms=LAST_WORDS_MS)  # the report must leave before the process ends
        raise
