"""The batch and parallel-sampling paths against their naive equivalents, on a running server.

    python bench/bench_batch.py --base-url http://127.0.0.1:30000

(1) 64 prompts in one batched /generate call vs the same 64 prompts as concurrent single
    requests: wall time and output tokens/s.
(2) n = 8 on a ~1,000-token prompt vs 8 independent requests of that prompt: prompt tokens
    actually computed (prompt_tokens - cached_tokens, summed) and wall time. The cache is
    flushed before each so both start cold.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time

import httpx
from bench_serving import make_prompt


async def post(client: httpx.AsyncClient, url: str, body: dict):
    r = await client.post(url, json=body)
    r.raise_for_status()
    return r.json()


def computed(results: list[dict]) -> int:
    return sum(r["meta_info"]["prompt_tokens"] - r["meta_info"]["cached_tokens"] for r in results)


async def run(args) -> None:
    rng = random.Random(0)
    url = args.base_url.rstrip("/")
    params = {"max_new_tokens": args.output_len, "temperature": 0, "ignore_eos": True}
    prompts = [make_prompt(rng, args.prompt_words) for _ in range(args.num_prompts)]
    async with httpx.AsyncClient(timeout=3600) as client:
        await client.post(url + "/flush_cache")
        start = time.perf_counter()
        batched = await post(client, url + "/generate", {"text": prompts, "sampling_params": params})
        batched_s = time.perf_counter() - start

        await client.post(url + "/flush_cache")
        start = time.perf_counter()
        singles = await asyncio.gather(
            *(post(client, url + "/generate", {"text": p, "sampling_params": params}) for p in prompts)
        )
        singles_s = time.perf_counter() - start
        tokens = sum(r["meta_info"]["completion_tokens"] for r in batched)
        print(f"(1) {len(prompts)} prompts x {args.output_len} tokens")
        print(f"    one batched call:      {batched_s:7.2f} s  {tokens / batched_s:7.1f} output tok/s")
        tokens = sum(r["meta_info"]["completion_tokens"] for r in singles)
        print(f"    {len(prompts)} concurrent singles:  {singles_s:7.2f} s  {tokens / singles_s:7.1f} output tok/s")

        long_prompt = make_prompt(rng, args.long_prompt_words)
        sample = {"max_new_tokens": args.sample_len, "temperature": 1.0, "ignore_eos": True}
        await client.post(url + "/flush_cache")
        start = time.perf_counter()
        parallel = await post(
            client, url + "/generate", {"text": long_prompt, "sampling_params": {**sample, "n": args.n}}
        )
        parallel_s = time.perf_counter() - start

        await client.post(url + "/flush_cache")
        start = time.perf_counter()
        independent = await asyncio.gather(
            *(post(client, url + "/generate", {"text": long_prompt, "sampling_params": sample}) for _ in range(args.n))
        )
        independent_s = time.perf_counter() - start
        prompt_tokens = parallel[0]["meta_info"]["prompt_tokens"]
        print(f"(2) n={args.n} on a {prompt_tokens}-token prompt, {args.sample_len} tokens each")
        # The warm-up computes the prompt once; the children only their last token.
        print(
            f"    n={args.n} (parallel sampling): {parallel_s:7.2f} s  "
            f"prompt tokens computed by samples: {computed(parallel)} (+{prompt_tokens} once for the warm-up)"
        )
        print(
            f"    {args.n} independent requests:  {independent_s:7.2f} s  "
            f"prompt tokens computed: {computed(independent)}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:30000")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--prompt-words", type=int, default=100)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--long-prompt-words", type=int, default=760, help="about 1,000 tokens")
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--sample-len", type=int, default=32)
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
