"""What structured output costs: output tokens/s with a JSON schema against without, at one
stream and at 32, one sluice server, the same prompts, one run.

    python bench/bench_structured.py
    python bench/bench_structured.py --model path/to/model.gguf --output-len 256

The schema asks for an array of at least 64 objects, so no request can end before
--output-len tokens (like ignore_eos without a schema); every request streams through
/v1/completions with `response_format` set, temperature 0.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).parent))
from bench_serving import run as run_workload
from compare_servers import PORT, REPO, THREADS, wait_until_serving

from sluice.model_files import default_model_path

SCHEMA = {
    "type": "array",
    "minItems": 64,
    "items": {
        "type": "object",
        "properties": {"id": {"type": "integer"}, "name": {"type": "string", "maxLength": 16}},
        "required": ["id", "name"],
        "additionalProperties": False,
    },
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "items", "schema": SCHEMA}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: SmolLM2")
    parser.add_argument("--output-len", type=int, default=128)
    args = parser.parse_args()
    base_url = f"http://127.0.0.1:{PORT}"
    command = [sys.executable, "-m", "sluice", "serve", "--port", str(PORT), "--num-threads", str(THREADS)]
    command += ["--model-path", args.model or default_model_path()]
    process = subprocess.Popen(command, cwd=REPO, start_new_session=True, stdout=subprocess.DEVNULL)
    try:
        wait_until_serving(base_url, process, 300)
        warm_up = SimpleNamespace(
            base_url=base_url,
            model="",
            request_rate=0.0,
            timeout_s=600,
            seed=0,
            num_prompts=2,
            concurrency=2,
            prompt_words=16,
            shared_prefix_words=0,
            output_len=8,
            extra_body={"response_format": RESPONSE_FORMAT},
        )
        asyncio.run(run_workload(warm_up))
        rows = []
        for streams in (1, 32):
            for label, extra in (("free", None), ("json_schema", {"response_format": RESPONSE_FORMAT})):
                options = SimpleNamespace(
                    base_url=base_url,
                    model="",
                    request_rate=0.0,
                    timeout_s=1800,
                    seed=streams,
                    num_prompts=4 if streams == 1 else 64,
                    concurrency=streams,
                    prompt_words=64,
                    shared_prefix_words=0,
                    output_len=args.output_len,
                    extra_body=extra,
                )
                result = asyncio.run(run_workload(options))
                assert result["requests_failed"] == 0, result.get("first_error")
                rows.append((streams, label, result))
                print(f"{streams:3d} streams {label:12s} {result['output_tokens_per_s']:8.1f} tok/s", flush=True)
        print(f"\n{'streams':>8s} {'free tok/s':>12s} {'schema tok/s':>13s} {'cost':>7s}")
        for streams in (1, 32):
            free, constrained = (r["output_tokens_per_s"] for s, _, r in rows if s == streams)
            print(f"{streams:8d} {free:12.1f} {constrained:13.1f} {1 - constrained / free:7.1%}")
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=30)


if __name__ == "__main__":
    main()
