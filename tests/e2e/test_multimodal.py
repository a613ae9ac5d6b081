"""Images through the real server: a tiny random LLaVA (built in a fixture), and the
default text-only model for the refusals."""

from __future__ import annotations

import base64
import io
import statistics
import threading
import time

import httpx
import numpy as np
import pytest
from PIL import Image
from transformers import AutoTokenizer

from tests.helpers import RunningServer, generate, greedy
from tests.tiny_vlm import IMAGE_TOKEN, build_tiny_llava

MAX_TOTAL_TOKENS = 400


def png_bytes(seed: int, size: int = 48) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def b64(seed: int, size: int = 48) -> str:
    return base64.b64encode(png_bytes(seed, size)).decode()


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("media")
    (folder / "cat.png").write_bytes(png_bytes(7))
    return folder


@pytest.fixture(scope="module")
def vlm(tmp_path_factory, media_dir):
    folder = build_tiny_llava(tmp_path_factory.mktemp("tiny-llava"))
    server = RunningServer(
        "--model-path",
        str(folder),
        "--max-total-tokens",
        str(MAX_TOTAL_TOKENS),
        "--allowed-local-media-path",
        str(media_dir),
        "--max-images-per-request",
        "3",
    )
    server.folder = folder
    yield server
    server.stop()


def test_image_request_reports_image_tokens(vlm):
    r = generate(vlm.base_url, text="Describe the picture.", image_data=b64(1), sampling_params=greedy(6))
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    info = httpx.get(vlm.base_url + "/get_model_info").json()
    assert meta["image_tokens"] > 1
    assert meta["prompt_tokens"] >= meta["image_tokens"]
    assert info["max_req_input_len"] == MAX_TOTAL_TOKENS - 1


def test_a_request_may_hold_no_more_than_the_kv_cache(vlm):
    """The cache holds 400 tokens, the model's context is 2,048: 400 is what a request may
    hold, so none can outgrow the cache and then wait for room forever."""
    assert httpx.get(vlm.base_url + "/get_model_info").json()["context_len"] == MAX_TOTAL_TOKENS
    refused = generate(vlm.base_url, text="Hi", sampling_params=greedy(MAX_TOTAL_TOKENS))
    assert refused.status_code == 400 and str(MAX_TOTAL_TOKENS) in refused.json()["error"]["message"]
    prompt_tokens = generate(vlm.base_url, text="Hi", sampling_params=greedy(1)).json()["meta_info"]["prompt_tokens"]
    whole = generate(vlm.base_url, text="Hi", sampling_params=greedy(MAX_TOTAL_TOKENS - prompt_tokens, ignore_eos=True))
    assert (
        whole.status_code == 200 and whole.json()["meta_info"]["completion_tokens"] == MAX_TOTAL_TOKENS - prompt_tokens
    )


def test_same_image_reuses_the_cache_and_different_images_do_not(vlm):
    first = generate(vlm.base_url, text="What is this?", image_data=b64(2), sampling_params=greedy(2)).json()
    again = generate(vlm.base_url, text="What is this?", image_data=b64(2), sampling_params=greedy(2)).json()
    other = generate(vlm.base_url, text="What is this?", image_data=b64(3), sampling_params=greedy(2)).json()
    image_tokens = first["meta_info"]["image_tokens"]
    assert again["meta_info"]["cached_tokens"] >= image_tokens
    assert again["output_ids"] == first["output_ids"]
    assert other["meta_info"]["cached_tokens"] == 0  # the image comes first: nothing shared


def test_data_url_and_local_file(vlm, media_dir):
    data_url = "data:image/png;base64," + b64(7)
    by_url = generate(vlm.base_url, text="Hi", image_data=data_url, sampling_params=greedy(3))
    by_path = generate(vlm.base_url, text="Hi", image_data=str(media_dir / "cat.png"), sampling_params=greedy(3))
    assert by_url.status_code == 200 and by_path.status_code == 200
    assert by_url.json()["output_ids"] == by_path.json()["output_ids"]  # same pixels, same answer


@pytest.mark.parametrize(
    "image, words",
    [
        ("/etc/passwd", "allowed"),
        ("bm90IGFuIGltYWdl", "decoded"),
        ("http://127.0.0.1:9/x.png", "remote"),
    ],
)
def test_bad_images_are_400(vlm, image, words):
    r = generate(vlm.base_url, text="Hi", image_data=image, sampling_params=greedy(2))
    assert r.status_code == 400, r.text
    assert words in r.json()["error"]["message"]


def test_too_many_images_is_400(vlm):
    r = generate(vlm.base_url, text="Hi", image_data=[b64(i) for i in range(4)], sampling_params=greedy(2))
    assert r.status_code == 400 and "3" in r.json()["error"]["message"]


def too_long_prompt(vlm, margin: int = 8) -> tuple[str, int]:
    """A prompt that fits while its image is one token and not once the Scheduler expands it
    (`margin` leaves room for a chat template's tokens)."""
    limit = httpx.get(vlm.base_url + "/get_model_info").json()["max_req_input_len"]
    return " hello" * (limit - margin), limit


def assert_refused_by_the_scheduler(r: httpx.Response, limit: int) -> None:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "BadRequestError" and error["code"] == 400, error
    assert error["message"].startswith("Multimodal prompt is too long after expanding image tokens:")
    assert f">= {limit}" in error["message"]


def test_expanded_prompt_too_long_is_aborted_by_the_scheduler(vlm):
    text, limit = too_long_prompt(vlm)
    assert_refused_by_the_scheduler(
        generate(vlm.base_url, text=text, image_data=b64(4), sampling_params=greedy(2)), limit
    )


def test_a_stream_the_scheduler_refuses_is_a_real_400_in_both_apis(vlm):
    """The refusal comes back as the first chunk: the status line waited for it."""
    text, limit = too_long_prompt(vlm)
    chat_text, _ = too_long_prompt(vlm, margin=20)
    native = {"text": text, "image_data": b64(4), "sampling_params": greedy(2), "stream": True}
    chat = {
        "max_tokens": 2,
        "stream": True,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": chat_text},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64," + b64(4)}},
                ],
            }
        ],
    }
    for path, body in (("/generate", native), ("/v1/chat/completions", chat)):
        assert_refused_by_the_scheduler(httpx.post(vlm.base_url + path, json=body, timeout=120), limit)
    info = httpx.get(vlm.base_url + "/get_server_info").json()
    assert info["internal_states"][0]["rid_to_state_size"] == 0


def test_openai_chat_with_image_parts(vlm):
    body = {
        "model": "",
        "max_tokens": 4,
        "temperature": 0,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is in the image?"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64," + b64(5)}},
                ],
            }
        ],
    }
    r = httpx.post(vlm.base_url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4


def test_batch_mixing_text_and_images_takes_the_sequential_path(vlm):
    r = generate(
        vlm.base_url, text=["Just text.", "With a picture."], image_data=[[], [b64(6)]], sampling_params=greedy(3)
    )
    assert r.status_code == 200, r.text
    results = r.json()
    assert [res["meta_info"]["path"] for res in results] == ["batch_sequential"] * 2
    assert results[0]["meta_info"]["image_tokens"] == 0 and results[1]["meta_info"]["image_tokens"] > 0


def test_a_bad_image_in_a_batch_names_its_item(vlm):
    """Every item numbers its images from 0: "image 0" alone did not say which prompt's."""
    r = generate(
        vlm.base_url,
        text=["With a picture.", "With a broken one."],
        image_data=[[b64(6)], ["data:image/png;base64,AAAA"]],
        sampling_params=greedy(3),
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith("item 1: image 0: "), r.text


def test_parallel_sampling_with_an_image_reuses_the_image_prefix(vlm):
    r = generate(
        vlm.base_url,
        text="Tell me about it.",
        image_data=b64(8),
        sampling_params={"n": 3, "max_new_tokens": 3, "temperature": 1.0},
    )
    assert r.status_code == 200, r.text
    for res in r.json():
        assert res["meta_info"]["cached_tokens"] >= res["meta_info"]["prompt_tokens"] - 1


def test_health_answers_while_images_are_preprocessed(vlm):
    """/health answers between 64 image requests, and every one of them completes.

    That preprocessing runs off the event loop is asserted in
    tests/unit/test_multimodal_media.py; here only the latency is printed, as nothing asserts on time.
    """
    big = b64(9, size=768)
    done = []

    def send():
        done.append(generate(vlm.base_url, text="Hi", image_data=big, sampling_params=greedy(1)).status_code)

    threads = [threading.Thread(target=send) for _ in range(64)]
    for t in threads:
        t.start()
    latencies = []
    while len(latencies) < 5 or any(t.is_alive() for t in threads):
        probe_start = time.perf_counter()
        assert httpx.get(vlm.base_url + "/health", timeout=60).status_code == 200
        latencies.append(time.perf_counter() - probe_start)
        time.sleep(0.05)
    for t in threads:
        t.join()
    print(f"\n/health under 64 image requests: median {statistics.median(latencies):.3f} s over {len(latencies)}")
    assert done.count(200) == 64


def test_text_only_model_refuses_images_naming_it(base_url):
    r = generate(base_url, text="Hi", image_data=b64(1), sampling_params=greedy(2))
    assert r.status_code == 400
    assert "does not accept images" in r.json()["error"]["message"] and "SmolLM2" in r.json()["error"]["message"]


def test_prompt_logprobs_of_a_prompt_with_an_image(vlm):
    """Image positions hold no text token: their logprob is null and they show the image token
    the prompt was sent with; the text after the image is scored, and the server lives on."""
    r = generate(
        vlm.base_url,
        text="Describe the picture.",
        image_data=b64(4),
        sampling_params=greedy(2),
        return_logprob=True,
        logprob_start_len=0,
        top_logprobs_num=2,
    )
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    entries, tops = meta["input_token_logprobs"], meta["input_top_logprobs"]
    assert len(entries) == len(tops) == meta["prompt_tokens"]
    unscored = [i for i, (logprob, _, _) in enumerate(entries) if logprob is None]
    image_token = AutoTokenizer.from_pretrained(vlm.folder).convert_tokens_to_ids(IMAGE_TOKEN)
    image = [i for i, (_, token, _) in enumerate(entries) if token == image_token]
    assert len(image) == meta["image_tokens"]
    assert set(unscored) == {0, *image}
    assert all(entries[i][0] <= 0 and len(tops[i]) == 2 for i in range(len(entries)) if i not in unscored)
    assert generate(vlm.base_url, text="Hi", image_data=b64(5), sampling_params=greedy(2)).status_code == 200


def test_an_image_counts_its_expanded_tokens_against_the_context(vlm):
    """The image is one token in the request and many in the Scheduler: the room left for
    max_new_tokens is the context less the expanded prompt (it was the unexpanded one, and
    the output was cut short with finish_reason length)."""
    probe = generate(vlm.base_url, text="Hi", image_data=b64(8), sampling_params=greedy(1)).json()["meta_info"]
    room = MAX_TOTAL_TOKENS - probe["prompt_tokens"]
    over = generate(vlm.base_url, text="Hi", image_data=b64(8), sampling_params=greedy(room + 1))
    assert over.status_code == 400 and over.json()["error"]["param"] == "max_new_tokens", over.text
    fits = generate(vlm.base_url, text="Hi", image_data=b64(8), sampling_params=greedy(room, ignore_eos=True))
    assert fits.status_code == 200 and fits.json()["meta_info"]["completion_tokens"] == room, fits.text
    # Chat's default max_tokens is the room left too.
    image_part = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + b64(8)}}
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}, image_part]}], "ignore_eos": True}
    chat = httpx.post(vlm.base_url + "/v1/chat/completions", json=body, timeout=120)
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["total_tokens"] == MAX_TOTAL_TOKENS


def test_an_image_token_without_its_image_is_400(vlm):
    r = generate(vlm.base_url, text=f"{IMAGE_TOKEN} what is this?", sampling_params=greedy(2))
    assert r.status_code == 400 and r.json()["error"]["param"] == "image_data", r.text


def test_logprob_start_len_counts_the_expanded_prompt(vlm):
    """As prompt_tokens does: the last two prompt tokens' logprobs are from prompt_tokens - 2."""
    probe = generate(vlm.base_url, text="Describe it.", image_data=b64(9), sampling_params=greedy(1))
    prompt_tokens = probe.json()["meta_info"]["prompt_tokens"]
    r = generate(
        vlm.base_url,
        text="Describe it.",
        image_data=b64(9),
        sampling_params=greedy(1),
        return_logprob=True,
        logprob_start_len=prompt_tokens - 2,
    )
    assert r.status_code == 200, r.text
    assert len(r.json()["meta_info"]["input_token_logprobs"]) == 2
