"""What a TokenizerManager needs before it serves: the tokenizer and chat template, a
vision-language model's image pipeline, and one warm-up generation. Shared by the main
process (`launch`) and every HTTP worker process (`server/worker`)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Final

from sluice.config import ServerArgs
from sluice.messages import SchedulerReady
from sluice.sampling import ClientError
from sluice.tokenizer.control import BackendError
from sluice.tokenizer.io_struct import GenerateReqInput
from sluice.tokenizer.manager import TokenizerManager
from sluice.tokenizer.multimodal.media import MediaLimits
from sluice.tokenizer.multimodal.processor import ImageProcessor, MultimodalProcessor
from sluice.tokenizer.multimodal.request_images import RequestImages
from sluice.tokenizer_files import ChatTemplate, TokenizerUnreadable, load_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

# The warm-up generation runs the model once end to end; on a busy CPU its first step
# (kernel build, allocator warm-up) can take a while.
WARMUP_TIMEOUT_S: Final = 120.0


def load_tokenizer_side(server_args: ServerArgs) -> tuple[PreTrainedTokenizerBase, ChatTemplate | None]:
    """The tokenizer and chat template of the served model: (tokenizer, ChatTemplate | None)."""
    model_path = server_args.resolved_model_path()
    tokenizer = load_tokenizer(model_path)
    return tokenizer, ChatTemplate.from_model(model_path, tokenizer)


def load_multimodal_processor(
    server_args: ServerArgs, scheduler_info: SchedulerReady, tokenizer: PreTrainedTokenizerBase
) -> RequestImages | None:
    """The image pipeline of a vision-language model; None for a text-only model."""
    if scheduler_info.image_token_id is None:
        return None
    image_processor = ImageProcessor.from_model(server_args.resolved_model_path())
    if image_processor is None:
        raise TokenizerUnreadable(
            f"{server_args.resolved_model_path()}: the vision-language model has no image processor config "
            "(preprocessor_config.json)"
        )
    limits = MediaLimits(
        max_images_per_request=server_args.max_images_per_request,
        max_image_bytes=server_args.max_image_bytes,
        max_image_pixels=server_args.max_image_pixels,
        allowed_local_media_path=server_args.allowed_local_media_path,
        allow_remote_media=server_args.allow_remote_media,
    )
    return RequestImages(MultimodalProcessor(image_processor, limits), tokenizer, scheduler_info.image_token_id)


async def warm_up(tm: TokenizerManager, rid: str = "WARMUP") -> None:
    obj = GenerateReqInput(
        text="The capital of France is",
        sampling_params={"max_new_tokens": 4, "temperature": 0},
        rid=rid,
        log_metrics=False,  # not a client's request
    )
    # Not held by a pause: a worker slower to start than the others warms up while they pause.
    # One that fails means the model cannot serve (a step that raises, limits that refuse
    # every prompt): the server must not report ready.
    last = None
    try:
        async for chunk in tm.generate_request(obj, hold_at_gate=False):
            last = chunk
    except ClientError as e:
        raise BackendError(f"the warm-up request was refused: {e.message}") from None
    reason = last.finish_reason if last is not None else None
    if last is None or (reason is not None and reason.type == "abort"):
        why = reason.message if reason is not None and reason.message else "it got no answer"
        raise BackendError(f"the warm-up request failed: {why}")
    logger.info("warm-up generated %r", last.text)
