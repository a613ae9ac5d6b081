"""Data parallelism on this machine, one run (issue 17):

1. `--dp-size 1` with all cores against `--dp-size N` (N = cores) with one thread each, at
   one stream (4 requests) and at 32 streams (96 requests), ~100-word prompts, 128 tokens out,
   streaming /v1/completions (bench_serving.py).
2. On `--dp-size N`: 64 requests over 8 distinct ~1,000-word prefixes (plus a short
   question each), 16 at a time, through /generate: `cache_aware` against `round_robin`,
   request throughput and the share of prompt tokens read from the radix caches.

    python bench/bench_data_parallel.py
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from bench_serving import make_prompt, workload_options
from bench_serving import run as run_workload
from compare_servers import PORT, REPO, wait_until_serving

BASE_URL = f"http://127.0.0.1:{PORT}"
PREFIXES = 8
PREFIX_REQUESTS = 64
PREFIX_CONCURRENCY = 16


class Server:
    def __init__(self, *flags: str):
        command = [sys.executable, "-m", "sluice", "serve", "--port", str(PORT), *flags]
        self.process = subprocess.Popen(command, cwd=REPO, start_new_session=True, stdout=subprocess.DEVNULL)
        try:
            wait_until_serving(BASE_URL, self.process, 300)
        except BaseException:
            self.__exit__()
            raise

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc) -> None:
        os.killpg(self.process.pid, signal.SIGTERM)
        self.process.wait(timeout=30)


def streams(concurrency: int, num_prompts: int, seed: int) -> dict:
    options = workload_options(BASE_URL, num_prompts, concurrency, seed=seed)
    result = asyncio.run(run_workload(options))
    assert result["requests_failed"] == 0, result.get("first_error")
    return result


async def shared_prefixes(seed: int) -> tuple[float, float]:
    """Requests/s and cached prompt tokens / prompt tokens."""
    rng = random.Random(seed)
    prefixes = [make_prompt(rng, 1000) for _ in range(PREFIXES)]
    order = [i % PREFIXES for i in range(PREFIX_REQUESTS)]
    rng.shuffle(order)
    bodies = [
        {"text": f"{prefixes[k]}\nQuestion {i}: {make_prompt(rng, 24)}", "sampling_params": {"max_new_tokens": 16}}
        for i, k in enumerate(order)
    ]
    semaphore = asyncio.Semaphore(PREFIX_CONCURRENCY)
    async with httpx.AsyncClient(timeout=1800) as client:

        async def one(body: dict) -> dict:
            async with semaphore:
                response = await client.post(BASE_URL + "/generate", json=body)
                response.raise_for_status()
                return response.json()["meta_info"]

        start = time.perf_counter()
        metas = await asyncio.gather(*(one(body) for body in bodies))
        duration = time.perf_counter() - start
    cached = sum(meta["cached_tokens"] for meta in metas)
    prompt = sum(meta["prompt_tokens"] for meta in metas)
    return len(metas) / duration, cached / prompt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=os.cpu_count() or 2)
    args = parser.parse_args()
    cores, n = os.cpu_count() or 1, args.replicas
    rows = []
    for label, flags in (
        (f"dp 1 x {cores} threads", ["--dp-size", "1", "--num-threads", str(cores)]),
        (f"dp {n} x {max(cores // n, 1)} thread(s)", ["--dp-size", str(n)]),
    ):
        with Server(*flags):
            info = httpx.get(BASE_URL + "/get_server_info", timeout=30).json()["execution"]
            print(f"{label}: cpu flags {info.get('cpu_flags')}; kernels {info.get('kernels_isa')}", flush=True)
            streams(2, 4, seed=99)  # warm
            one = streams(1, 4, seed=1)
            many = streams(32, 96, seed=2)
            rows.append((label, one, many))
            print(
                f"  1 stream {one['output_tokens_per_s']:.1f} tok/s (TTFT p50 {one['ttft_p50_ms']:.0f} ms); "
                f"32 streams {many['output_tokens_per_s']:.1f} tok/s (TTFT p50 {many['ttft_p50_ms']:.0f} ms)",
                flush=True,
            )
    placement = []
    for method in ("cache_aware", "round_robin"):
        with Server("--dp-size", str(n), "--load-balance-method", method):
            rate, ratio = asyncio.run(shared_prefixes(seed=3))
            placement.append((method, rate, ratio))
            print(f"dp {n} {method}: {rate:.2f} req/s, cached {ratio:.1%} of prompt tokens", flush=True)

    print(f"\n{'setting':24s} {'1 stream tok/s':>15s} {'32 streams tok/s':>17s} {'TTFT p50 32 (ms)':>17s}")
    for label, one, many in rows:
        print(
            f"{label:24s} {one['output_tokens_per_s']:15.1f} {many['output_tokens_per_s']:17.1f} "
            f"{many['ttft_p50_ms']:17.0f}"
        )
    print(f"\n{PREFIX_REQUESTS} requests over {PREFIXES} ~1,000-word prefixes, {PREFIX_CONCURRENCY} at a time, dp {n}:")
    for method, rate, ratio in placement:
        print(f"  {method:12s} {rate:6.2f} req/s   cached {ratio:6.1%}")


if __name__ == "__main__":
    main()
