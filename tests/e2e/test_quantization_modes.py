"""`--quantization gguf` through the real server: every number of the GGUF kept. The default
model holds Q4_1 and Q8_0 blocks only, which `auto` keeps as they are too, so both modes
must give the same greedy tokens, and a bad mode is refused at start-up."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers import RunningServer, generate, greedy

PROMPT = "Name the capital of France."


def test_gguf_mode_serves_the_tokens_of_the_default_mode(base_url):
    expected = generate(base_url, text=PROMPT, sampling_params=greedy(12, ignore_eos=True))
    assert expected.status_code == 200, expected.text
    server = RunningServer("--quantization", "gguf", "--skip-warmup")
    try:
        r = generate(server.base_url, text=PROMPT, sampling_params=greedy(12, ignore_eos=True))
        assert r.status_code == 200, r.text
        assert r.json()["output_ids"] == expected.json()["output_ids"]
    finally:
        server.stop()


def test_an_unknown_quantization_mode_is_refused_naming_the_choices():
    result = subprocess.run(
        [sys.executable, "-m", "sluice", "serve", "--quantization", "q4_k"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode != 0
    assert "auto, none, q8_0 or gguf" in result.stderr + result.stdout
