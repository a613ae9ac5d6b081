"""Attention: sluice's C kernel against torch's SDPA.

    python bench/bench_attention.py                       # SmolLM2's heads, prompts of 512..8192
    python bench/bench_attention.py --lengths 8192 --kv-dtypes float16
    python bench/bench_attention.py --decode 32 --lengths 200 --kv-dtypes float16
    python bench/bench_attention.py --decode 16 --lengths 1250 --shared-prefix 1200 --kv-dtypes float16

Prompts (the default): one layer; sluice attends every prompt token over the pool at its
position (so a request's result never depends on chunking or batching), once as decode rows
(float32 vectors) and once flagged as prompt rows (on an amx_bf16 build: bf16 tiles; other
builds ignore the flag); SDPA computes the same causal attention on contiguous q/k/v in
float32 and in bfloat16 (its flash kernel; vLLM's CPU path runs bf16). Prints microseconds
per prompt token.

--decode N: one decode step of N requests with --lengths cached tokens each, over --layers
layers' pools (so the K/V rows come from memory, as in a model), slots shuffled over each
pool; SDPA attends the same rows gathered into contiguous float32 tensors beforehand (its
gather not timed). Prints milliseconds per step and the K/V bytes sluice read per second
(counting a shared prefix once per request). --shared-prefix P: every request's first P
slots are the same (a system prompt in the radix cache). --slot-runs R: each request's slots
come in runs of R consecutive pool rows (the runs shuffled), as a paged or run-reserving
allocator would lay them out; 1 (the default) scatters every row.
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

KV_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "fp8_e5m2": torch.float8_e5m2,
}


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
    parser.add_argument("--decode", type=int, default=0, metavar="N", help="a decode step of N requests instead")
    parser.add_argument("--layers", type=int, default=30, help="--decode: layers (pools) a step reads")
    parser.add_argument(
        "--slot-runs", type=int, default=1, metavar="R", help="--decode: a request's slots come in runs of R in a row"
    )
    parser.add_argument("--shared-prefix", type=int, default=0, metavar="P", help="--decode: slots all requests share")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ops = KernelOps(load_kernels(args.isa))
    print(f"CPU flags: {' '.join(reported_flags())}; kernels: {ops.kernels.describe()}")
    if args.decode:
        bench_decode_step(ops, args)
        return
    print(
        f"{'tokens':>7s} {'kv dtype':>9s} {'sluice us/token':>16s} {'as prompt rows':>15s} "
        f"{'SDPA f32':>9s} {'SDPA bf16':>10s} {'prompt/bf16':>12s}"
    )
    for length in args.lengths:
        generator = torch.Generator().manual_seed(length)
        q = torch.randn(length, args.heads, args.head_dim, generator=generator)
        k = torch.randn(length, args.kv_heads, args.head_dim, generator=generator)
        v = torch.randn(length, args.kv_heads, args.head_dim, generator=generator)
        sdpa_s, sdpa_bf16_s = (
            timed(
                functools.partial(
                    F.scaled_dot_product_attention,
                    *(x.transpose(0, 1).unsqueeze(0).to(dtype) for x in (q, k, v)),
                    is_causal=True,
                    enable_gqa=True,
                )
            )
            for dtype in (torch.float32, torch.bfloat16)
        )
        slots = torch.randperm(length) + 1  # the pool's order is not the sequence's
        seq_lens = torch.arange(1, length + 1)
        slot_rows = torch.zeros(length, dtype=torch.int64)
        for name in args.kv_dtypes:
            k_pool = torch.zeros(length + 1, args.kv_heads, args.head_dim, dtype=KV_DTYPES[name])
            v_pool = torch.zeros_like(k_pool)
            k_pool[slots], v_pool[slots] = k.to(k_pool.dtype), v.to(k_pool.dtype)
            attend = functools.partial(ops.decode_attention, q, k_pool, v_pool, slots, seq_lens, length, slot_rows)
            sluice_s = timed(attend)
            prompt_s = timed(functools.partial(attend, prompt_rows=torch.ones(length, dtype=torch.bool)))
            print(
                f"{length:7d} {name:>9s} {sluice_s / length * 1e6:16.2f} {prompt_s / length * 1e6:15.2f} "
                f"{sdpa_s / length * 1e6:9.2f} {sdpa_bf16_s / length * 1e6:10.2f} {prompt_s / sdpa_bf16_s:12.2f}",
                flush=True,
            )


def sluice_decode_step(ops: KernelOps, q, pools, slots, seq_lens, length: int) -> None:
    for k_pool, v_pool in pools:
        ops.decode_attention(q, k_pool, v_pool, slots, seq_lens, length)


def sdpa_decode_step(q_heads, gathered) -> None:
    for keys, values in gathered:
        F.scaled_dot_product_attention(q_heads, keys, values, enable_gqa=True)


def bench_decode_step(ops: KernelOps, args: argparse.Namespace) -> None:
    requests, layers = args.decode, args.layers
    print(f"{'tokens':>7s} {'kv dtype':>9s} {'sluice ms/step':>15s} {'GB/s':>6s} {'SDPA ms/step':>13s} {'ratio':>6s}")
    for length in args.lengths:
        generator = torch.Generator().manual_seed(length)
        q = torch.randn(requests, args.heads, args.head_dim, generator=generator)
        num_slots = requests * length + 1
        # Runs of --slot-runs consecutive slots, the runs in random order over the pool.
        run = args.slot_runs
        runs = torch.randperm((num_slots - 1) // run, generator=generator)
        slots = (runs[:, None] * run + torch.arange(run)).reshape(-1) + 1
        seq_lens = torch.full((requests,), length)
        rows = slots.view(requests, length)
        rows[:, : args.shared_prefix] = rows[0, : args.shared_prefix].clone()
        for name in args.kv_dtypes:
            pools = [
                tuple(
                    torch.randn(num_slots, args.kv_heads, args.head_dim, generator=generator).to(KV_DTYPES[name])
                    for _ in range(2)
                )
                for _ in range(layers)
            ]

            gathered = [
                tuple(pool[rows].float().permute(0, 2, 1, 3).contiguous() for pool in layer_pools)
                for layer_pools in pools
            ]
            sluice_step = functools.partial(sluice_decode_step, ops, q, pools, slots, seq_lens, length)
            sdpa_step = functools.partial(sdpa_decode_step, q.unsqueeze(2), gathered)
            sluice_s, sdpa_s = timed(sluice_step), timed(sdpa_step)
            kv_bytes = 2 * layers * requests * length * args.kv_heads * args.head_dim * KV_DTYPES[name].itemsize
            print(
                f"{length:7d} {name:>9s} {sluice_s * 1e3:15.2f} {kv_bytes / sluice_s / 1e9:6.1f} "
                f"{sdpa_s * 1e3:13.2f} {sluice_s / sdpa_s:6.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
