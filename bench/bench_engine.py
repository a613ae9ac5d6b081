"""The model engine without HTTP: decode and prefill speed next to transformers and the
machine's raw limits, all measured in this one run.

    python bench/bench_engine.py                          # full table (takes a while)
    python bench/bench_engine.py --batch-sizes 1 8 --dtypes float32 --new-tokens 32
    python bench/bench_engine.py --quantization auto none    # sluice's default path and the dense one

`--quantization auto` is the server default: on the default GGUF, decode tokens read the
file's Q4_1/Q8_0 blocks through the C kernel; transformers runs the dequantized float
weights (it has no such path), so the `none` rows are the like-for-like comparison.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from sluice.config import ServerArgs
from sluice.messages import SamplingParams, TokenizedGenerateReqInput
from sluice.model.model_runner import ModelRunner
from sluice.procutil import keep_freed_memory_for_reuse
from sluice.scheduler.scheduler import Scheduler

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def raw_limits(threads: int) -> dict[str, float]:
    torch.set_num_threads(threads)
    out = {}
    for name, dtype in DTYPES.items():
        a = torch.randn(1024, 1024, dtype=dtype)
        b = torch.randn(1024, 1024, dtype=dtype)
        a @ b
        reps, start = 5, time.perf_counter()
        for _ in range(reps):
            a @ b
        out[f"matmul_{name}_gflops"] = 2 * 1024**3 * reps / (time.perf_counter() - start) / 1e9
    big = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.float32).fill_(1.0)
    big.sum()
    start = time.perf_counter()
    for _ in range(5):
        big.sum()
    out["memory_read_gbps"] = big.numel() * 4 * 5 / (time.perf_counter() - start) / 1e9
    return out


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(count)]


def sluice_run(runner: ModelRunner, prompts: list[list[int]], new_tokens: int) -> tuple[float, float, float]:
    """Returns (prefill tokens/s, decode tokens/s, end-to-end generated tokens/s) for one batch."""
    args = ServerArgs(max_running_requests=max(len(prompts), 1), chunked_prefill_size=8192, max_prefill_tokens=1 << 20)
    scheduler = Scheduler(args, runner, max_total_tokens=len(prompts) * (len(prompts[0]) + new_tokens) + 64)
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0, ignore_eos=True)
    for i, ids in enumerate(prompts):
        scheduler.add_request(TokenizedGenerateReqInput(rid=str(i), input_ids=ids, sampling_params=params))
    start = time.perf_counter()
    scheduler.step()  # the whole batch prefills in one step
    prefill_s = time.perf_counter() - start
    start = time.perf_counter()
    steps = 0
    while not scheduler.is_idle:
        scheduler.step()
        steps += 1
    decode_s = time.perf_counter() - start
    prefill_tps = sum(len(p) for p in prompts) / prefill_s
    decode_tps = steps * len(prompts) / decode_s if steps else 0.0
    # Like transformers' figure below: every generated token over the whole time, prefill included.
    e2e_tps = len(prompts) * new_tokens / (prefill_s + decode_s)
    return prefill_tps, decode_tps, e2e_tps


def transformers_run(
    model_path: str, dtype: torch.dtype, prompts: list[list[int]], new_tokens: int
) -> tuple[float, float, float]:
    """transformers' generate on the same prompts: (prefill tokens/s, decode tokens/s, end-to-end
    generated tokens/s). Prefill is timed as a generate of one token; decode is the rest of a
    full generate, spread over its remaining tokens."""
    model = _load_transformers(model_path, dtype)
    ids = torch.tensor(prompts)

    def generate(count: int) -> float:
        start = time.perf_counter()
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=count,
            min_new_tokens=count,
            do_sample=False,
            pad_token_id=0,
        )
        return time.perf_counter() - start

    with torch.inference_mode():
        model.generate(ids[:, :8], max_new_tokens=2, do_sample=False)
        prefill_s = generate(1)
        total_s = generate(new_tokens)
    batch = len(prompts)
    decode_s = max(total_s - prefill_s, 1e-9)
    return batch * len(prompts[0]) / prefill_s, batch * (new_tokens - 1) / decode_s, batch * new_tokens / total_s


_hf_cache: dict = {}


def _load_transformers(model_path: str, dtype: torch.dtype):
    import os

    from transformers import AutoModelForCausalLM

    if dtype not in _hf_cache:
        if model_path.endswith(".gguf"):
            model = AutoModelForCausalLM.from_pretrained(
                os.path.dirname(model_path), gguf_file=os.path.basename(model_path), dtype=dtype
            )
        else:
            model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
        _hf_cache.clear()
        _hf_cache[dtype] = model.eval()
    return _hf_cache[dtype]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", default="")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument(
        "--dtypes",
        nargs="+",
        default=["auto"],
        choices=["auto", *DTYPES],
        help="sluice's --dtype (auto: float32 on the C kernels where they run); transformers runs float32 for auto",
    )
    parser.add_argument(
        "--kv-cache-dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16", "fp8_e5m2"]
    )
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quantization", nargs="+", default=["auto", "none"], choices=["auto", "none", "q8_0", "gguf"])
    parser.add_argument("--skip-transformers", action="store_true")
    args = parser.parse_args()

    model_path = ServerArgs(model_path=args.model_path).resolved_model_path()
    limits = raw_limits(args.threads)
    print("raw limits: " + ", ".join(f"{k} {v:.1f}" for k, v in limits.items()))
    print(
        f"{'dtype':9s} {'quant':>5s} {'batch':>5s} {'prefill tok/s':>14s} {'decode tok/s':>13s} "
        f"{'end-to-end tok/s':>17s}   transformers prefill / decode / end-to-end   ratios (prefill, decode, e2e)"
    )
    nan = float("nan")
    hf_tps: dict[tuple[str, int], tuple[float, float, float]] = {}
    for dtype_name in args.dtypes:
        for quantization in args.quantization:
            torch.set_num_threads(args.threads)
            runner = ModelRunner(model_path, dtype_name, quantization, args.kv_cache_dtype)
            keep_freed_memory_for_reuse()  # as the Scheduler process does
            print(
                f"sluice --dtype {dtype_name} --quantization {quantization}: "
                + "; ".join(f"{key} {value}" for key, value in runner.execution_info.items()),
                flush=True,
            )
            hf_dtype = DTYPES.get(dtype_name, torch.float32)
            for batch in args.batch_sizes:
                prompts = random_prompts(batch, args.prompt_len, runner.config.vocab_size, seed=batch)
                prefill_tps, decode_tps, e2e_tps = sluice_run(runner, prompts, args.new_tokens)
                key = (dtype_name, batch)
                if key not in hf_tps:
                    hf_tps[key] = (
                        (nan, nan, nan)
                        if args.skip_transformers
                        else transformers_run(model_path, hf_dtype, prompts, args.new_tokens)
                    )
                hf_prefill, hf_decode, hf_e2e = hf_tps[key]
                print(
                    f"{dtype_name:9s} {quantization:>5s} {batch:5d} {prefill_tps:14.1f} {decode_tps:13.1f} "
                    f"{e2e_tps:17.1f}   {hf_prefill:9.1f} / {hf_decode:7.1f} / {hf_e2e:7.1f}          "
                    f"{prefill_tps / hf_prefill:5.2f} {decode_tps / hf_decode:5.2f} {e2e_tps / hf_e2e:5.2f}",
                    flush=True,
                )
            del runner


if __name__ == "__main__":
    main()
