"""Prompt attention of one layer: sluice's C kernel against torch's SDPA (its flash kernel).

    python bench/bench_attention.py                       # SmolLM2's heads, prompts of 512..8192
    python bench/bench_attention.py --lengths 8192 --kv-dtypes float16

sluice attends every prompt token over the pool at its position (so a request's result
never depends on chunking or batching); SDPA computes the same causal attention on
contiguous q/k/v in float32. Prints microseconds per prompt token for one layer.
"""

from __future__ import annotations

import argparse
import functools
import time

import torch
import torch.nn.functional as F

from sluice.kernels.cpu import reported_flags
from sluice.kernels.loader import load_kernels
from sluice.kernels.ops import KernelOps

KV_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def timed(function, min_s: float = 1.0) -> float:
    function()
    runs, start = 0, time.perf_counter()
    while runs < 2 or time.perf_counter() - start < min_s:
        function()
        runs += 1
    return (time.perf_counter() - start) / runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--kv-dtypes", nargs="+", default=["float32", "float16"], choices=list(KV_DTYPES))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--isa", default=None, help="kernel build (default: the best this CPU runs)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ops = KernelOps(load_kernels(args.isa))
    print(f"CPU flags: {' '.join(reported_flags())}; kernels: {ops.kernels.describe()}")
    print(f"{'tokens':>7s} {'kv dtype':>9s} {'sluice us/token':>16s} {'SDPA us/token':>14s} {'ratio':>6s}")
    for length in args.lengths:
        generator = torch.Generator().manual_seed(length)
        q = torch.randn(length, args.heads, args.head_dim, generator=generator)
        k = torch.randn(length, args.kv_heads, args.head_dim, generator=generator)
        v = torch.randn(length, args.kv_heads, args.head_dim, generator=generator)
        sdpa_s = timed(
            functools.partial(
                F.scaled_dot_product_attention,
                q.transpose(0, 1).unsqueeze(0),
                k.transpose(0, 1).unsqueeze(0),
                v.transpose(0, 1).unsqueeze(0),
                is_causal=True,
                enable_gqa=True,
            )
        )
        slots = torch.randperm(length) + 1  # the pool's order is not the sequence's
        seq_lens = torch.arange(1, length + 1)
        slot_rows = torch.zeros(length, dtype=torch.int64)
        for name in args.kv_dtypes:
            k_pool = torch.zeros(length + 1, args.kv_heads, args.head_dim, dtype=KV_DTYPES[name])
            v_pool = torch.zeros_like(k_pool)
            k_pool[slots], v_pool[slots] = k.to(k_pool.dtype), v.to(k_pool.dtype)
            sluice_s = timed(
                functools.partial(ops.decode_attention, q, k_pool, v_pool, slots, seq_lens, length, slot_rows)
            )
            print(
                f"{length:7d} {name:>9s} {sluice_s / length * 1e6:16.2f} {sdpa_s / length * 1e6:14.2f} "
                f"{sluice_s / sdpa_s:6.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
