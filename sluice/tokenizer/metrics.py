"""Prometheus metrics of the request path, for GET /metrics.

The TokenizerManager records what happened to each request when it ends (tokens, how it
ended, how long each stage took); the Scheduler's gauges (running, waiting, KV use) are
read from its InternalState at scrape time, so they are never stale.

With several HTTP workers each worker records in its own process: prometheus-client's
multiprocess mode keeps every worker's values in files under PROMETHEUS_MULTIPROC_DIR (a
folder in the server's private IPC directory, set before the workers start), and a scrape
on any worker sums them. One process keeps them in its own registry.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector

from sluice.messages import InternalState, ReqOutput
from sluice.tokenizer.req_state import ReqState

MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
PREFIX = "sluice:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Seconds; CPU serving is slower than GPU serving, so the buckets reach further.
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)


class RequestMetrics:
    def __init__(self) -> None:
        self.multiprocess = MULTIPROC_DIR_ENV in os.environ
        # Multiprocess mode: the values live in files and the scrape reads them all.
        registry = None if self.multiprocess else CollectorRegistry()
        self.registry = registry

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, labels, registry=registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, buckets=buckets, registry=registry)

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of ended requests.")
        self.generation_tokens = counter("generation_tokens", "Output tokens of ended requests.")
        self.cached_tokens = counter("cached_tokens", "Prompt tokens read from the radix cache.")
        self.requests = counter("requests", "Ended requests, by how they ended.", ("finish_reason",))
        self.rejected = counter("requests_rejected", "Requests refused for the server's load.", ("reason",))
        self.ttft = histogram("time_to_first_token_seconds", "From received to the first output token.", _TTFT_BUCKETS)
        self.itl = histogram(
            "inter_token_latency_seconds",
            "Between output tokens: one observation per streamed output after the first (its gap over its "
            "tokens), one per non-streamed request (its mean).",
            _ITL_BUCKETS,
        )
        self.e2e = histogram("e2e_request_latency_seconds", "From received to the last output.", _E2E_BUCKETS)
        self.queue_time = histogram(
            "queue_time_seconds", "From tokenized (sent to the Scheduler) to first put in a batch.", _TTFT_BUCKETS
        )

    def on_output(self, state: ReqState, output: ReqOutput, previous_token_at: float, now: float) -> None:
        """A streamed output that brought tokens after the first."""
        if state.log_metrics and state.stream and previous_token_at and output.new_token_ids:
            self.itl.observe((now - previous_token_at) / len(output.new_token_ids))

    def on_finish(self, state: ReqState, output: ReqOutput, now: float) -> None:
        if not state.log_metrics:
            return
        reason = output.finish_reason
        if reason is not None and reason.rejected is not None:
            self.rejected.labels(reason.rejected).inc()
            return
        if state.path == "prefix_warmup":  # the server's own prefill for n > 1: not a request
            return
        self.requests.labels(reason.type if reason is not None else "abort").inc()
        self.prompt_tokens.inc(output.prompt_tokens)
        self.generation_tokens.inc(output.completion_tokens)
        self.cached_tokens.inc(output.cached_tokens)
        self.e2e.observe(now - state.received_at)
        if state.scheduled_at:
            self.queue_time.observe(max(state.scheduled_at - state.tokenized_at, 0.0))
        if state.first_token_at:
            self.ttft.observe(state.first_token_at - state.received_at)
            if not state.stream and output.completion_tokens > 1:
                self.itl.observe((now - state.first_token_at) / (output.completion_tokens - 1))

    def on_ended_unrun(self, count: int) -> None:
        """Requests (items, samples) that an abort, or their client leaving, ended before they
        were sent: while the gate held them, or while they were tokenized."""
        self.requests.labels("abort").inc(count)

    def on_rejected(self, reason: str) -> None:
        self.rejected.labels(reason).inc()

    def render(self, scheduler: InternalState | None) -> bytes:
        """The exposition text: the request metrics (every worker's) and the Scheduler's gauges
        (None: it did not answer; only `scheduler_up` 0 then)."""
        registry = CollectorRegistry()
        registry.register(_SchedulerGauges(scheduler))
        if self.multiprocess:
            MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
            return generate_latest(registry)
        assert self.registry is not None
        return generate_latest(self.registry) + generate_latest(registry)


class _SchedulerGauges:
    """The Scheduler's state at scrape time (None: it did not answer in time)."""

    def __init__(self, state: InternalState | None) -> None:
        self.state = state

    def collect(self) -> Iterator[Metric]:
        s = self.state
        yield _gauge("scheduler_up", "1 when the Scheduler answered this scrape, else 0.", int(s is not None))
        if s is None:
            return
        yield _gauge("num_requests_running", "Requests in the running batch.", s.num_running_reqs)
        yield _gauge("num_requests_waiting", "Requests waiting to run.", s.num_waiting_reqs)
        usage = s.kv_tokens_in_use / s.kv_tokens_total
        yield _gauge("kv_cache_usage_ratio", "Share of KV slots held by running requests.", usage)
        yield _gauge(
            "num_retractions",
            "Requests sent back to the waiting queue since start (KV full, preemption).",
            s.num_retractions,
        )
        yield _gauge(
            "num_failed_steps",
            "Scheduler steps that failed since start; each ended its requests with a 500.",
            s.num_failed_steps,
        )


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + name, doc, value=value)
