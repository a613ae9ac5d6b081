"""Drive any OpenAI-compatible server and print throughput, TTFT and ITL.

Each request is a streaming /v1/completions call with temperature 0 and ignore_eos, so
every request produces exactly --output-len tokens (on servers that honour ignore_eos).

    python bench/bench_serving.py --base-url http://127.0.0.1:30000 --num-prompts 32 --concurrency 32
    python bench/bench_serving.py --request-rate 2 --num-prompts 64      # Poisson arrivals
    python bench/bench_serving.py --shared-prefix-words 750 --prompt-words 25 --output-len 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import aiohttp
import uvloop

WORDS = (
    "time person year way day thing man world life hand part child eye woman place work week case point "
    "government company number group problem fact water river mountain city house garden music story light "
    "morning evening window table paper letter voice reason history science market energy forest ocean "
    "question answer friend family school student teacher doctor garden winter summer spring autumn"
).split()


def make_prompt(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


@dataclass
class RequestResult:
    ok: bool
    output_tokens: int = 0
    ttft_s: float = 0.0
    latency_s: float = 0.0
    itls_s: list[float] = field(default_factory=list)
    error: str = ""
    retried: bool = False  # the first attempt's connection closed with no response
    responded: bool = False  # the server sent a status line


async def one_request(
    session: aiohttp.ClientSession, url: str, model: str, prompt: str, output_len: int, extra_body: dict | None = None
) -> RequestResult:
    """One streamed request. Where the server closes the connection within a second with no
    response at all (a kept-alive one it dropped as the request went out), the request is sent
    once more, as clients do (the OpenAI SDK retries connection errors twice); its times count
    from the first attempt."""
    body = {
        **(extra_body or {}),
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    for attempt in (1, 2):
        result = RequestResult(ok=False, retried=attempt > 1)
        try:
            return await _stream(session, url, body, result, start)
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as e:  # closed or reset, or the write failed
            elapsed_s = time.perf_counter() - start
            result.error = f"{e!r} after {elapsed_s:.1f} s"
            if result.responded or elapsed_s >= 1.0:
                return result
        except (TimeoutError, aiohttp.ClientError) as e:
            result.error = repr(e)
            return result
    return result


async def _stream(
    session: aiohttp.ClientSession, url: str, body: dict, result: RequestResult, start: float
) -> RequestResult:
    last = start
    chunks_with_text = 0
    async with session.post(url, json=body) as response:
        result.responded = True
        if response.status != 200:
            result.error = f"HTTP {response.status}: {(await response.read())[:200]!r}"
            return result
        async for line in response.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                result.output_tokens = chunk["usage"]["completion_tokens"]
            choice = (chunk.get("choices") or [{}])[0]
            now = time.perf_counter()
            # The first token arrives with the first text, or with the finish when no token
            # had text of its own (a one-token answer can be a byte that decodes to "").
            if not result.ttft_s and (choice.get("text") or choice.get("finish_reason")):
                result.ttft_s = now - start
            if not choice.get("text"):
                continue
            if chunks_with_text > 0:
                result.itls_s.append(now - last)
            last = now
            chunks_with_text += 1
    result.latency_s = time.perf_counter() - start
    result.ttft_s = result.ttft_s or result.latency_s  # a stream with neither text nor a finish
    result.output_tokens = result.output_tokens or chunks_with_text
    result.ok = True
    return result


def percentiles(values: list[float]) -> tuple[float, float, float]:
    if not values:
        return (0.0, 0.0, 0.0)
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return statistics.fmean(ordered), statistics.median(ordered), p99


def workload_options(
    base_url: str, num_prompts: int, concurrency: int, seed: int = 0, prompt_words: int = 100, output_len: int = 128
) -> SimpleNamespace:
    """The options `run` takes, as the command line would give them: all requests at once
    (no request rate), no shared prefix, the first served model."""
    return SimpleNamespace(
        base_url=base_url,
        model="",
        request_rate=0.0,
        timeout_s=1800,
        seed=seed,
        num_prompts=num_prompts,
        concurrency=concurrency,
        prompt_words=prompt_words,
        shared_prefix_words=0,
        output_len=output_len,
    )


async def run(args) -> dict:
    rng = random.Random(args.seed)
    prefix = make_prompt(rng, args.shared_prefix_words) + "\n" if args.shared_prefix_words else ""
    prompts = [prefix + make_prompt(rng, args.prompt_words) for _ in range(args.num_prompts)]
    url = args.base_url.rstrip("/") + "/v1/completions"
    connector = aiohttp.TCPConnector(limit=args.concurrency + 8)
    # Per connect and per read, as httpx's were: a long stream or a long queue is no timeout.
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=args.timeout_s, sock_read=args.timeout_s)
    # Lines up to 2 MiB (a chunk with logprobs through --extra-body), 4x aiohttp's default.
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, read_bufsize=2**20) as client:
        if not args.model:
            async with client.get(args.base_url.rstrip("/") + "/v1/models") as response:
                model = (await response.json())["data"][0]["id"]
        else:
            model = args.model
        semaphore = asyncio.Semaphore(args.concurrency)

        async def limited(prompt: str) -> RequestResult:
            async with semaphore:
                return await one_request(client, url, model, prompt, args.output_len, getattr(args, "extra_body", None))

        start = time.perf_counter()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(limited(prompt)))
            if args.request_rate > 0:
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration_s = time.perf_counter() - start

    ok = [r for r in results if r.ok]
    ttft = percentiles([r.ttft_s for r in ok])
    itl = percentiles([x for r in ok for x in r.itls_s])
    output_tokens = sum(r.output_tokens for r in ok)
    # Decode speed as one client sees it: tokens after the first over the time they took.
    # Only streams whose tokens came as two or more chunks with text (their first token's time
    # is then the first text's, not a finish that came with all of them).
    decode_rates = [
        (r.output_tokens - 1) / (r.latency_s - r.ttft_s)
        for r in ok
        if r.itls_s and r.latency_s > r.ttft_s and r.output_tokens > 1
    ]
    summary = {
        "requests_ok": len(ok),
        "requests_failed": len(results) - len(ok),
        "requests_retried": sum(r.retried for r in results),
        "duration_s": duration_s,
        "request_throughput": len(ok) / duration_s,
        "output_tokens": output_tokens,
        "output_tokens_per_s": output_tokens / duration_s,
        "ttft_mean_ms": ttft[0] * 1000,
        "ttft_p50_ms": ttft[1] * 1000,
        "ttft_p99_ms": ttft[2] * 1000,
        "itl_mean_ms": itl[0] * 1000,
        "itl_p50_ms": itl[1] * 1000,
        "itl_p99_ms": itl[2] * 1000,
        "decode_tokens_per_s_per_stream": statistics.fmean(decode_rates) if decode_rates else 0.0,
    }
    errors = [r.error for r in results if not r.ok]
    if errors:
        summary["first_error"] = errors[0]
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:30000")
    parser.add_argument("--model", default="", help="model name (default: the first of /v1/models)")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=1, help="most requests in flight")
    parser.add_argument("--request-rate", type=float, default=0.0, help="Poisson arrivals per second (0: all at once)")
    parser.add_argument("--prompt-words", type=int, default=100, help="about 1.3 tokens per word")
    parser.add_argument("--shared-prefix-words", type=int, default=0, help="a prefix every prompt shares")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--timeout-s", type=float, default=1800)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--extra-body", type=json.loads, default=None, help="fields added to every request (a JSON object)"
    )
    args = parser.parse_args()
    summary = uvloop.run(run(args))
    if args.json:
        print(json.dumps(summary))
        return
    for key, value in summary.items():
        print(f"{key:34s} {value:.2f}" if isinstance(value, float) else f"{key:34s} {value}")


if __name__ == "__main__":
    main()
