"""Images to pixel tensors: the model's HF image processor, run in a thread pool.

The TokenizerManager awaits `MultimodalProcessor.process`; loading, decoding, hashing
and preprocessing all run in worker threads so the event loop keeps serving streams.
The result crosses to the Scheduler as raw bytes + dtype + shape (`ProcessedImage`),
which `pixels_to_tensor` turns back into a tensor there.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import msgspec
import numpy as np
from PIL import Image

from sluice.sampling import ClientError
from sluice.tokenizer.multimodal import media
from sluice.tokenizer.multimodal.media import MediaLimits

if TYPE_CHECKING:
    import torch
    from transformers.image_processing_utils import BaseImageProcessor

# A model folder holds its image processor's settings in one of these.
_PROCESSOR_CONFIG_FILES = ("preprocessor_config.json", "processor_config.json")


class ProcessedImage(msgspec.Struct, kw_only=True):
    pixel_values: bytes
    dtype: str  # numpy dtype name: "float32"
    shape: list[int]  # [3, height, width] after preprocessing
    hash: int  # image_hash of the decoded pixels
    original_size: list[int]  # [height, width] as the client sent it


def image_hash(image: Image.Image) -> int:
    """A stable 64-bit hash of the decoded pixels, as a signed int64 (fits torch.int64).

    Pixels rather than the encoded bytes: the same picture sent as a PNG file and as a
    base64 data URL of the same PNG (or re-encoded losslessly) hashes equal, so their
    prompts share radix-cache prefixes. Mode and size are part of it: equal bytes
    arranged as 2x3 and 3x2 are different images.
    """
    digest = hashlib.blake2b(digest_size=8)
    digest.update(f"{image.mode}:{image.width}x{image.height}:".encode())
    digest.update(image.tobytes())
    return int.from_bytes(digest.digest(), "little", signed=True)


def has_image_processor(path: str) -> bool:
    """The model folder at `path` holds an image processor's settings (a GGUF file never does)."""
    return any(os.path.isfile(os.path.join(path, name)) for name in _PROCESSOR_CONFIG_FILES)


class ImageProcessor:
    """The model's HF image processor, returning one float32 [N, 3, H, W] array."""

    def __init__(self, hf_processor: BaseImageProcessor) -> None:
        self.hf_processor = hf_processor

    @classmethod
    def from_model(cls, path: str) -> ImageProcessor | None:
        """The folder's image processor; None when the folder has no processor config.

        A config that exists but does not load is an error, not a text-only model.
        """
        if not has_image_processor(path):
            return None
        from transformers import AutoImageProcessor

        try:
            return cls(AutoImageProcessor.from_pretrained(path, local_files_only=True))
        except (OSError, ValueError) as error:
            raise ValueError(f"the image processor in {path} could not be loaded: {error}") from error

    def preprocess(self, images: list[Image.Image]) -> np.ndarray:
        pixel_values = self.hf_processor(images=images, return_tensors="np")["pixel_values"]
        pixel_values = np.asarray(pixel_values)
        if pixel_values.ndim != 4 or pixel_values.shape[0] != len(images) or pixel_values.shape[1] != 3:
            raise ValueError(f"the image processor returned shape {pixel_values.shape}; expected [N, 3, H, W]")
        return np.ascontiguousarray(pixel_values, dtype=np.float32)


class MultimodalProcessor:
    """What the TokenizerManager calls: client image references in, ProcessedImages out."""

    def __init__(self, image_processor: ImageProcessor, limits: MediaLimits, max_workers: int = 2) -> None:
        self.image_processor = image_processor
        self.limits = limits
        self.pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="sluice-media")

    async def process(self, image_refs: list[str]) -> list[ProcessedImage]:
        """Load, decode and preprocess each image in the pool; ClientError on the first bad one."""
        limit = self.limits.max_images_per_request
        if len(image_refs) > limit:
            raise ClientError(
                f"the request has {len(image_refs)} images, more than max_images_per_request={limit}", "image_data"
            )
        loop = asyncio.get_running_loop()
        jobs = [loop.run_in_executor(self.pool, self.process_one, ref, i) for i, ref in enumerate(image_refs)]
        try:
            return list(await asyncio.gather(*jobs))
        except BaseException:
            for job in jobs:  # queued ones need not run; running ones finish and are dropped
                job.cancel()
            raise

    def process_one(self, ref: str, index: int = 0) -> ProcessedImage:
        """The whole pipeline for one image. Blocks: call it from a worker thread."""
        data = media.load_image_bytes(ref, self.limits, index)
        image = media.decode_image(data, self.limits, index)
        pixels = self.image_processor.preprocess([image])[0]
        return ProcessedImage(
            pixel_values=pixels.tobytes(),
            dtype=str(pixels.dtype),
            shape=list(pixels.shape),
            hash=image_hash(image),
            original_size=[image.height, image.width],
        )

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


_TENSOR_DTYPES = ("float32", "float16")


def pixels_to_tensor(p: ProcessedImage) -> torch.Tensor:
    """The Scheduler side: the [3, H, W] tensor a ProcessedImage (or ImageInput) carries."""
    import torch

    if p.dtype not in _TENSOR_DTYPES:
        raise ValueError(f"unsupported pixel dtype {p.dtype!r}; expected one of {_TENSOR_DTYPES}")
    dtype = np.dtype(p.dtype)
    expected_bytes = int(np.prod(p.shape)) * dtype.itemsize
    if len(p.pixel_values) != expected_bytes:
        raise ValueError(f"pixel buffer has {len(p.pixel_values)} bytes; shape {p.shape} needs {expected_bytes}")
    # frombuffer over bytes is read-only; the copy gives torch a writable tensor it owns.
    array = np.frombuffer(p.pixel_values, dtype=dtype).reshape(p.shape).copy()
    return torch.from_numpy(array)
