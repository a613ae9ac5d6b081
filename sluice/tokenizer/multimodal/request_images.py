"""The image side of a request to a vision-language model, before tokenization: the
TokenizerManager's `mm_processor`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sluice.messages import ImageInput
from sluice.sampling import ClientError
from sluice.tokenizer.multimodal.processor import MultimodalProcessor

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class RequestImages:
    def __init__(self, processor: MultimodalProcessor, tokenizer: PreTrainedTokenizerBase, image_token_id: int) -> None:
        self.processor = processor
        self.image_token_id = image_token_id
        image_token = tokenizer.convert_ids_to_tokens(image_token_id)
        if not isinstance(image_token, str):
            raise ValueError(f"the image token id {image_token_id} is not one token of the vocabulary")
        self.image_token = image_token

    async def process(self, refs: list[str]) -> list[ImageInput]:
        """Load and preprocess images off the event loop; pixels travel as raw bytes."""
        processed = await self.processor.process(refs)
        return [
            ImageInput(pixel_values=p.pixel_values, dtype=p.dtype, shape=list(p.shape), hash=p.hash) for p in processed
        ]

    def prompt_with_placeholders(self, text: str, num_images: int) -> str:
        """The prompt with one image token per image: the client's own, or put first."""
        if num_images and self.image_token not in text:
            return f"{self.image_token}\n" * num_images + text
        return text

    def check_tokens(self, input_ids: list[int], num_images: int) -> None:
        found = input_ids.count(self.image_token_id)
        if found != num_images:
            raise ClientError(f"the prompt has {found} image tokens for {num_images} images", "image_data")
