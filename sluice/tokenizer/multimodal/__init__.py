"""Images in requests: loading and checking media, and preprocessing it into pixel tensors."""

from sluice.tokenizer.multimodal.media import MediaLimits, decode_image, load_image_bytes
from sluice.tokenizer.multimodal.processor import (
    ImageProcessor,
    MultimodalProcessor,
    ProcessedImage,
    image_hash,
    pixels_to_tensor,
)

__all__ = [
    "ImageProcessor",
    "MediaLimits",
    "MultimodalProcessor",
    "ProcessedImage",
    "decode_image",
    "image_hash",
    "load_image_bytes",
    "pixels_to_tensor",
]
