"""Which weights get a block-quantized copy, from `--quantization` and the model file.

    none  every weight stays dense (the reference path)
    q8_0  every linear weight gets a q8_0 copy
    auto  a GGUF file's quantized matrices as the fastest kernel format on this CPU that keeps
          their quants: Q4_0/Q4_1 as q4_1, Q5_0/Q5_1 as q5_1, Q8_0, Q5_K and Q6_K as
          themselves, Q4_K as q4_k on AVX2 and as q4_1 on AVX-512 and AMX (below), other
          quantized types (Q2_K, Q3_K, IQ4_NL, ...) rounded to q8_0 (gguf_blocks.py); float
          tensors and HF folders stay dense
    gguf  as auto, but Q4_K as q4_k on every CPU: every number of the file

Q4_K as q4_k keeps the file's numbers and reads 7.5% fewer bytes than as q4_1 (whose block
scales are rounded to float16, at most 2^-11 of themselves). Where memory bounds a decode step
that is worth more than q4_1's cheaper arithmetic: on an AVX2 Zen 3 the Llama-3.2-1B body
decoded 10% faster at one stream, its prompts 2.4-3.5% slower. On the AVX-512 Zen 4 q4_k was no
faster at one stream and 7% slower at 32 (measured before the block prefetch). On the AMX
Xeon both run on the int8 tiles for batches, and 16,384 x 2,048 at 32 rows took 2.37-2.51 ms
as q4_k against 2.13-2.31 as q4_1, at 4 rows (the VNNI code) 0.51 against 0.42-0.43, so
those keep q4_1.

Blocks run only on the C kernels (float32 activations): on the torch backend `auto` keeps
every weight dense and `q8_0` is refused.
"""

from __future__ import annotations

from pathlib import Path

from sluice.model.backend import Backend, KernelBackend
from sluice.model.block_rows import BlockFormat
from sluice.model.gguf_blocks import FIVE_BIT_TYPES, FOUR_BIT_TYPES
from sluice.model.model_config import ModelConfig, is_gguf
from sluice.model.weights import FLOAT_TYPES, FormatPlan, gguf_tensor_types

QUANTIZATION_MODES = ("auto", "none", "q8_0", "gguf")
# The GGUF types that run as a kernel format of their own, on every CPU.
_KEPT_SUPER_BLOCKS = {"Q5_K": BlockFormat.Q5_K, "Q6_K": BlockFormat.Q6_K}
# The kernel builds on which `auto` runs Q4_K as q4_1 (see above).
Q4_K_AS_Q4_1_ISAS = ("avx512_vnni", "amx_int8", "amx_bf16")


def quantization_plan(model_path: str | Path, config: ModelConfig, mode: str, backend: Backend) -> FormatPlan | None:
    """Maps a HF weight name to its block format; None when nothing is quantized.

    "auto" stays dense on the torch backend and for a vision-language model; an explicit
    "q8_0" or "gguf" where it cannot apply (there, or "gguf" for a HF folder) raises ValueError.
    """
    if mode not in QUANTIZATION_MODES:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_MODES)}, not {mode!r}")
    # An explicit mode that cannot apply is refused: the model would run dense without a word.
    if mode == "gguf" and not is_gguf(model_path):
        raise ValueError("--quantization gguf keeps a GGUF file's blocks, and this model is a HF folder")
    if config.vision is not None:
        if mode in ("q8_0", "gguf"):
            raise ValueError(f"--quantization {mode}: a vision-language model runs dense (leave it at auto or none)")
        return None
    if mode == "none":
        return None
    if not isinstance(backend, KernelBackend):
        if mode in ("q8_0", "gguf"):
            raise ValueError(
                f"--quantization {mode} needs the C kernels and float32 activations "
                f"(this model runs on the {backend.name} backend)"
            )
        return None
    if mode == "q8_0":
        return lambda name: BlockFormat.Q8_0
    if not is_gguf(model_path):
        return None
    types = gguf_tensor_types(model_path, config)
    if all(kind in FLOAT_TYPES for kind in types.values()):
        return None
    kept = dict(_KEPT_SUPER_BLOCKS)
    if mode == "gguf" or backend.isa not in Q4_K_AS_Q4_1_ISAS:
        kept["Q4_K"] = BlockFormat.Q4_K

    def format_of(name: str) -> BlockFormat | None:
        kind = types.get(name)
        if kind is None or kind in FLOAT_TYPES:
            return None
        if kind in kept:
            return kept[kind]
        if kind in FOUR_BIT_TYPES:
            return BlockFormat.Q4_1
        return BlockFormat.Q5_1 if kind in FIVE_BIT_TYPES else BlockFormat.Q8_0

    return format_of
