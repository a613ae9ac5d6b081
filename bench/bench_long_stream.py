"""Does a long stream slow down as it grows? One streamed /generate of many tokens.

    python bench/bench_long_stream.py --base-url http://127.0.0.1:30000 --max-new-tokens 4000 --server-pid PID

Streams one request (`ignore_eos`, greedy) and prints, over the first and the last
`--window` events, the mean time between SSE events and, with `--server-pid` (the
server's main process, on this machine), the CPU time each server process spent per
event. Attention over a longer sequence costs a little more per token whatever the server
does; everything else a step does (copying outputs, rebuilding logprob lists, building the
next batch) should not grow with the stream. CPU time per event tells that apart from the
machine's load, which moves wall time a lot on a shared machine. `--logprobs K` asks for
output logprobs with K alternatives, which the cumulative native stream format repeats in
every event. The server needs room for the whole sequence: the default model's context is
8,192 tokens and `--max-total-tokens` must cover prompt + max_new_tokens.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import time

import httpx

CLOCK_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def process_tree(pid: int) -> dict[str, int]:
    """The server's processes by name (`comm`): the main process and its children."""
    tree = {"main": pid}
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            for child in f.read().split():
                with open(f"/proc/{child}/comm") as comm:
                    tree[comm.read().strip()] = int(child)
    return tree


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS_PER_S


def stream(base_url: str, body: dict, pids: dict[str, int]) -> tuple[list[float], list[dict[str, float]], dict]:
    """Arrival time and server CPU seconds at each event, and the last event."""
    times: list[float] = []
    cpu: list[dict[str, float]] = []
    last = ""
    with httpx.stream("POST", base_url + "/generate", json=body, timeout=36000) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            times.append(time.perf_counter())
            cpu.append({name: cpu_s(pid) for name, pid in pids.items()})
            last = line
    return times, cpu, json.loads(last[len("data: ") :])


def per_event(times: list[float], cpu: list[dict[str, float]], start: int, end: int) -> str:
    gaps = [b - a for a, b in itertools.pairwise(times[start:end])]
    figures = [f"{statistics.mean(gaps) * 1000:8.2f} ms between events"]
    for name in cpu[0] if cpu else {}:
        figures.append(f"{name} {(cpu[end - 1][name] - cpu[start][name]) / (end - 1 - start) * 1000:6.2f}")
    return figures[0] + ("; CPU ms per event: " + ", ".join(figures[1:]) if len(figures) > 1 else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:30000")
    parser.add_argument("--max-new-tokens", type=int, default=4000)
    parser.add_argument("--window", type=int, default=200, help="events averaged at the start and at the end")
    parser.add_argument("--logprobs", type=int, default=None, help="return_logprob with this many alternatives")
    parser.add_argument("--server-pid", type=int, default=None, help="the server's main process, for CPU times")
    parser.add_argument("--prompt", default="Once upon a time")
    args = parser.parse_args()

    body: dict = {
        "text": args.prompt,
        "stream": True,
        "sampling_params": {"max_new_tokens": args.max_new_tokens, "temperature": 0, "ignore_eos": True},
    }
    if args.logprobs is not None:
        body.update(return_logprob=True, top_logprobs_num=args.logprobs)
    pids = process_tree(args.server_pid) if args.server_pid else {}
    started = time.perf_counter()
    times, cpu, final = stream(args.base_url.rstrip("/"), body, pids)
    total_s = time.perf_counter() - started
    window = min(args.window, len(times) // 2)
    print(
        f"{final['meta_info']['completion_tokens']} tokens in {len(times)} events, {total_s:.1f} s"
        f"{'' if args.logprobs is None else f', logprobs with {args.logprobs} alternatives'}"
    )
    # The first event follows the prefill: start after it.
    print(f"first {window} events: {per_event(times, cpu, 1, window + 1)}")
    print(f"last  {window} events: {per_event(times, cpu, len(times) - window, len(times))}")


if __name__ == "__main__":
    main()
