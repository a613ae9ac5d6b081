"""The Python side of kernels.h: function signatures read from the header itself, the shared
structs and constants, and the check that a loaded library agrees with them.

kernels.h is the one source. Signatures are parsed from its declarations, so a changed C
signature changes the binding; the structs and constants below are asked of the library
(`sluice_contract_value`) when it loads, so a layout that drifted refuses to load with a
message instead of corrupting memory.
"""

from __future__ import annotations

import ctypes
import enum
import re
from pathlib import Path

HEADER = Path(__file__).parent / "kernels.h"
BLOCK = 32  # SLUICE_BLOCK: weights per quantized block along K
SUPER_BLOCK = 256  # SLUICE_SUPER_BLOCK: weights per q4_k / q5_k / q6_k super-block along K


class BlockFormat(enum.IntEnum):
    """enum sluice_block_format."""

    Q8_0 = 0  # w = d * q, q int8, one scale per block
    Q4_1 = 1  # w = d * q + m, q 4-bit unsigned, scale and minimum per block
    Q6_K = 2  # w = d * sc * (q - 32), q 6-bit unsigned, int8 sc per 16 weights, d per 256 (GGUF's Q6_K)
    Q4_K = 3  # w = d * sc * q - dmin * mn, q 4-bit, 6-bit sc and mn per 32, d and dmin per 256 (GGUF's Q4_K)
    Q5_K = 4  # as Q4_K with q 5-bit (GGUF's Q5_K)
    Q5_1 = 5  # as Q4_1 with q 5-bit (GGUF's Q5_1; its Q5_0 with m = -16 d)


class Activation(enum.IntEnum):
    """enum sluice_activation: the gated MLP's activation."""

    SILU = 0
    GELU_TANH = 1


class KvDtype(enum.IntEnum):
    """enum sluice_kv_dtype: the element type of the KV pools."""

    FLOAT32 = 0
    FLOAT16 = 1
    BFLOAT16 = 2
    FP8_E5M2 = 3


_float_p = ctypes.POINTER(ctypes.c_float)
_byte_p = ctypes.POINTER(ctypes.c_uint8)


class Projection(ctypes.Structure):
    """sluice_projection."""

    _c_name_ = "sluice_projection"
    _fields_ = [
        ("packed", _byte_p),
        ("tail", _byte_p),
        ("format", ctypes.c_int),
        ("tail_format", ctypes.c_int),
        ("tail_rows", ctypes.c_int),
    ]


class LayerWeights(ctypes.Structure):
    """sluice_layer_weights."""

    _c_name_ = "sluice_layer_weights"
    _fields_ = [
        ("input_norm", _float_p),
        ("post_attention_norm", _float_p),
        ("qkv", Projection),
        ("o", Projection),
        ("gate_up", Projection),
        ("down", Projection),
        ("qkv_bias", _float_p),
        ("q_norm", _float_p),
        ("k_norm", _float_p),
        ("sliding_window", ctypes.c_int),
        ("pre_feedforward_norm", _float_p),
        ("post_feedforward_norm", _float_p),
        ("local_rope", ctypes.c_int),
    ]


class ModelDims(ctypes.Structure):
    """sluice_model_dims."""

    _c_name_ = "sluice_model_dims"
    _fields_ = [
        ("num_layers", ctypes.c_int),
        ("hidden", ctypes.c_int),
        ("heads", ctypes.c_int),
        ("kv_heads", ctypes.c_int),
        ("head_dim", ctypes.c_int),
        ("intermediate", ctypes.c_int),
        ("eps", ctypes.c_float),
        ("attention_scale", ctypes.c_float),
        ("kv_dtype", ctypes.c_int),
        ("mlp_activation", ctypes.c_int),
        ("attn_softcap", ctypes.c_float),
    ]


STRUCTS = (Projection, LayerWeights, ModelDims)
CONSTANTS = {
    "SLUICE_BLOCK": BLOCK,
    "SLUICE_SUPER_BLOCK": SUPER_BLOCK,
    **{f"SLUICE_{member.name}": member.value for member in BlockFormat},
    **{f"SLUICE_KV_{member.name}": member.value for member in KvDtype},
    **{f"SLUICE_{member.name}": member.value for member in Activation},
}

_SCALARS = {
    "void": None,
    "int": ctypes.c_int,
    "long": ctypes.c_long,
    "float": ctypes.c_float,
    "size_t": ctypes.c_size_t,
    "int64_t": ctypes.c_int64,
}
_DECLARATION = re.compile(r"([A-Za-z_][\w\s]*?)\s*(\**)\s*\b(sluice_\w+)\s*\(([^)]*)\)\s*;")
_MISSING = -(2**63)  # LONG_MIN: the library does not know the name


class ContractMismatch(RuntimeError):
    pass


def _ctype(declaration: str) -> type | None:
    """The ctypes type of a C parameter or return type: any pointer is a void pointer."""
    if "*" in declaration:
        return ctypes.c_void_p
    words = [word for word in declaration.split() if word != "const"]
    scalar = words[0] if words[0] in _SCALARS else None
    if scalar is None:
        raise ContractMismatch(f"kernels.h: no ctypes mapping for {declaration!r}")
    return _SCALARS[scalar]


def declared_signatures(header: str | None = None) -> dict[str, tuple[type | None, list[type | None]]]:
    """Every function kernels.h declares: name -> (restype, argtypes)."""
    text = HEADER.read_text() if header is None else header
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    signatures: dict[str, tuple[type | None, list[type | None]]] = {}
    for return_type, stars, name, raw_params in _DECLARATION.findall(text):
        params = raw_params.strip()
        argtypes = [] if params in ("", "void") else [_ctype(param) for param in params.split(",")]
        signatures[name] = (_ctype(return_type + stars), argtypes)
    return signatures


def bind(lib: ctypes.CDLL) -> None:
    """Give every declared function of `lib` its types; a missing one is a mismatch."""
    for name, (restype, argtypes) in declared_signatures().items():
        try:
            function = getattr(lib, name)
        except AttributeError:
            raise ContractMismatch(f"the library has no {name}, which kernels.h declares") from None
        function.restype = restype
        function.argtypes = argtypes


def check(lib: ctypes.CDLL) -> None:
    """Raise ContractMismatch unless the library's structs and constants are the ones used here."""

    def value(name: str) -> int:
        found = lib.sluice_contract_value(name.encode())
        if found == _MISSING:
            raise ContractMismatch(f"the kernels library does not report {name!r}")
        return found

    problems = []
    for struct in STRUCTS:
        if value(f"sizeof {struct._c_name_}") != ctypes.sizeof(struct):
            problems.append(
                f"sizeof {struct._c_name_}: C {value(f'sizeof {struct._c_name_}')}, Python {ctypes.sizeof(struct)}"
            )
        for field, *_ in struct._fields_:
            c_offset, py_offset = value(f"{struct._c_name_}.{field}"), getattr(struct, field).offset
            if c_offset != py_offset:
                problems.append(f"{struct._c_name_}.{field} at offset {c_offset} in C, {py_offset} in Python")
    for name, expected in CONSTANTS.items():
        if value(name) != expected:
            problems.append(f"{name} is {value(name)} in C, {expected} in Python")
    if problems:
        raise ContractMismatch("the kernels library disagrees with sluice/kernels/contract.py: " + "; ".join(problems))
