"""What operating a server costs, one sluice server, one run (issue 16):

1. /metrics: output tokens/s of 32 streams without and with a client scraping /metrics
   every second, in alternating rounds (off, on, off, on, ...), so drift hits both alike;
   each round's two runs send the same prompts, each from an empty prefix cache.
2. Embeddings: embeddings/s of /v1/embeddings, batches of 32 inputs of 128 token ids (new
   random ids each batch: no prefix cache hits), next to transformers on the same GGUF
   weights (float32, last-token pooling, normalised), timed in the same process run while
   the server is idle.

    python bench/bench_operations.py
    python bench/bench_operations.py --rounds 3 --model path/to/model.gguf
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from bench_serving import run as run_workload
from bench_serving import workload_options
from compare_servers import PORT, REPO, THREADS, wait_until_serving

from sluice.model.model_config import ModelConfig
from sluice.model_files import default_model_path

EMBED_BATCH = 32
EMBED_TOKENS = 128


def streams_workload(base_url: str, seed: int, num_prompts: int, output_len: int) -> SimpleNamespace:
    return workload_options(base_url, num_prompts, concurrency=32, seed=seed, output_len=output_len)


class ScrapeLoop:
    """Scrapes /metrics once a second on a thread while it runs; counts scrapes and their time."""

    def __init__(self, base_url: str):
        self.url = base_url + "/metrics"
        self.stop = threading.Event()
        self.seconds: list[float] = []
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> ScrapeLoop:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()

    def _run(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self.stop.is_set():
                start = time.perf_counter()
                response = client.get(self.url)
                response.raise_for_status()
                self.seconds.append(time.perf_counter() - start)
                self.stop.wait(max(0.0, 1.0 - (time.perf_counter() - start)))


def measure_metrics_cost(base_url: str, rounds: int, num_prompts: int, output_len: int) -> None:
    rates: dict[str, list[float]] = {"off": [], "on": []}
    scrapes: list[float] = []
    for round_index in range(rounds):
        for mode in ("off", "on"):
            # The same prompts in both modes, from an empty prefix cache each time.
            httpx.post(base_url + "/flush_cache", timeout=60).raise_for_status()
            workload = streams_workload(base_url, round_index, num_prompts, output_len)
            if mode == "on":
                with ScrapeLoop(base_url) as loop:
                    result = asyncio.run(run_workload(workload))
                scrapes.extend(loop.seconds)
            else:
                result = asyncio.run(run_workload(workload))
            assert result["requests_failed"] == 0, result.get("first_error")
            rates[mode].append(result["output_tokens_per_s"])
            print(f"round {round_index + 1} scrape {mode:3s} {result['output_tokens_per_s']:8.1f} tok/s", flush=True)
    off, on = statistics.fmean(rates["off"]), statistics.fmean(rates["on"])
    print(f"\n32 streams, {num_prompts} prompts x {output_len} tokens, {rounds} rounds each:")
    print(f"  without scraping {off:8.1f} tok/s  (rounds: {', '.join(f'{r:.1f}' for r in rates['off'])})")
    print(f"  scraping each 1 s {on:7.1f} tok/s  (rounds: {', '.join(f'{r:.1f}' for r in rates['on'])})")
    print(f"  cost {1 - on / off:+.2%}; {len(scrapes)} scrapes, p50 {statistics.median(scrapes) * 1000:.1f} ms each")


def random_batches(vocab: int, count: int, seed: int) -> list[list[list[int]]]:
    rng = random.Random(seed)
    return [[[rng.randrange(vocab) for _ in range(EMBED_TOKENS)] for _ in range(EMBED_BATCH)] for _ in range(count)]


def sluice_embeddings_per_s(base_url: str, batches: list[list[list[int]]]) -> float:
    with httpx.Client(timeout=600) as client:
        client.post(base_url + "/v1/embeddings", json={"input": batches[0][:2]}).raise_for_status()  # warm
        start = time.perf_counter()
        for batch in batches:
            response = client.post(base_url + "/v1/embeddings", json={"input": batch})
            response.raise_for_status()
            assert len(response.json()["data"]) == len(batch)
        return len(batches) * EMBED_BATCH / (time.perf_counter() - start)


def transformers_embeddings_per_s(model_path: str, batches: list[list[list[int]]]) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(THREADS)
    path = Path(model_path)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    with torch.inference_mode():
        model.model(torch.tensor(batches[0][:2]))  # warm
        start = time.perf_counter()
        for batch in batches:
            hidden = model.model(torch.tensor(batch)).last_hidden_state[:, -1]
            torch.nn.functional.normalize(hidden, dim=-1)
        return len(batches) * EMBED_BATCH / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a GGUF file; default: SmolLM2")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each scrape mode")
    parser.add_argument("--num-prompts", type=int, default=96)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--embed-batches", type=int, default=6)
    args = parser.parse_args()
    model_path = args.model or default_model_path()
    vocab_size = ModelConfig.from_path(model_path).vocab_size
    batches = random_batches(vocab_size, args.embed_batches, seed=1)
    base_url = f"http://127.0.0.1:{PORT}"
    command = [sys.executable, "-m", "sluice", "serve", "--port", str(PORT), "--num-threads", str(THREADS)]
    command += ["--model-path", model_path]
    process = subprocess.Popen(command, cwd=REPO, start_new_session=True, stdout=subprocess.DEVNULL)
    try:
        wait_until_serving(base_url, process, 300)
        execution = httpx.get(base_url + "/get_server_info", timeout=30).json()["execution"]
        print(f"cpu flags: {execution.get('cpu_flags')}; kernels: {execution.get('kernels_isa')}", flush=True)
        asyncio.run(run_workload(streams_workload(base_url, 99, 32, 16)))  # warm
        measure_metrics_cost(base_url, args.rounds, args.num_prompts, args.output_len)

        served = sluice_embeddings_per_s(base_url, batches)
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=30)
    # The server is gone: transformers has the two cores to itself, as sluice had.
    reference = transformers_embeddings_per_s(model_path, random_batches(vocab_size, args.embed_batches, seed=2))
    print(f"\nembeddings, batches of {EMBED_BATCH} x {EMBED_TOKENS} tokens, {args.embed_batches} batches:")
    print(f"  sluice /v1/embeddings {served:8.1f} embeddings/s")
    print(f"  transformers (fp32)   {reference:8.1f} embeddings/s  -> sluice / transformers {served / reference:.2f}x")


if __name__ == "__main__":
    main()
