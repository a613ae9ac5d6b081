"""What every route does with a hostile body, on the real server: JSON nested past the
limit is a 400 naming the limit, and the server is none the worse for it."""

from __future__ import annotations

import socket
import time

import httpx
import pytest

from sluice.server.json_body import MAX_JSON_DEPTH

BODY_ROUTES = ["/generate", "/v1/completions", "/v1/chat/completions", "/abort_request"]
DEEP_BODIES = {
    "text-50k-deep": b'{"text": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
    "bare-100k-deep": b"[" * 100_000 + b"]" * 100_000,
    "one-past-the-limit": b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1),
}


@pytest.mark.parametrize("body", DEEP_BODIES.values(), ids=DEEP_BODIES.keys())
@pytest.mark.parametrize("path", BODY_ROUTES)
def test_deep_nesting_is_400_naming_the_limit(base_url, path, body):
    r = httpx.post(base_url + path, content=body, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "BadRequestError" and f"the limit is {MAX_JSON_DEPTH}" in error["message"], error


def test_the_server_is_unharmed_by_deep_bodies(base_url):
    for body in DEEP_BODIES.values():
        httpx.post(base_url + "/v1/chat/completions", content=body, timeout=30)
    assert httpx.get(base_url + "/health", timeout=10).status_code == 200
    states = httpx.get(base_url + "/get_server_info", timeout=30).json()["internal_states"][0]
    assert states["rid_to_state_size"] == 0


@pytest.mark.parametrize("path", [*BODY_ROUTES, "/tokenize", "/v1/embeddings"])
def test_an_empty_body_is_400_saying_so(base_url, path):
    r = httpx.post(base_url + path, content=b"", headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] == "the body is empty: send a JSON object"


@pytest.mark.parametrize("body", [b"[1]", b'"rid"', b'{"rid": 5}', b'{"abort_all": "yes"}', b"{}"])
def test_abort_request_takes_only_its_own_shape(base_url, body):
    r = httpx.post(base_url + "/abort_request", content=body, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] in ("rid", "abort_all", None)


@pytest.mark.parametrize("path", [*BODY_ROUTES, "/pause_generation", "/update_weights_from_disk"])
def test_a_post_that_is_not_json_or_comes_from_another_site_is_refused(base_url, path):
    """A browser posts text/plain or a form cross-site without asking the server first: a
    web page must not pause or drive a server on the user's machine that way."""
    for content_type in ("text/plain", "application/x-www-form-urlencoded"):
        r = httpx.post(base_url + path, content=b'{"text": "Hi"}', headers={"content-type": content_type}, timeout=30)
        assert r.status_code == 415, r.text
        assert r.json()["error"]["type"] == "UnsupportedMediaType"
    cross_site = {"sec-fetch-site": "cross-site"}  # what a browser adds to another site's post
    assert httpx.post(base_url + path, content=b"", headers=cross_site, timeout=30).status_code == 403
    assert httpx.get(base_url + "/get_server_info", timeout=30).json()["internal_states"][0]["num_paused_reqs"] == 0
    assert httpx.post(base_url + "/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 1}}).is_success


@pytest.mark.parametrize("compressed", [True, False])
def test_a_compressed_body_is_415_naming_the_encoding(base_url, compressed):
    """A gzip body was a 400 saying it is not valid JSON; a plain one sent with the header was taken."""
    import gzip

    body = b'{"text": "Hi", "sampling_params": {"max_new_tokens": 1}}'
    headers = {"content-type": "application/json", "content-encoding": "gzip"}
    r = httpx.post(base_url + "/generate", content=gzip.compress(body) if compressed else body, headers=headers)
    assert r.status_code == 415, r.text
    assert r.json()["error"]["message"] == "Content-Encoding 'gzip' is not supported: send the body uncompressed"
    identity = {"content-type": "application/json", "content-encoding": "identity"}
    assert httpx.post(base_url + "/generate", content=body, headers=identity, timeout=30).is_success


def test_a_cache_flush_by_get_from_another_site_is_refused(base_url):
    """GET /flush_cache (as SGLang has it) from another site's page: an <img src> would do."""
    r = httpx.get(base_url + "/flush_cache", headers={"sec-fetch-site": "cross-site"}, timeout=30)
    assert r.status_code == 403 and "another site" in r.json()["error"]["message"]
    assert httpx.get(base_url + "/flush_cache", headers={"sec-fetch-site": "same-origin"}, timeout=30).is_success


HUGE_TEXT = "a " * 2_000_000  # 4 MB: 2 M tokens, far past max_req_input_len


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/generate", {"text": HUGE_TEXT, "sampling_params": {"max_new_tokens": 1}}, "text"),
        ("/v1/completions", {"prompt": HUGE_TEXT, "max_tokens": 1}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": HUGE_TEXT}], "max_tokens": 1}, "messages"),
        ("/v1/embeddings", {"input": HUGE_TEXT}, "input"),
    ],
)
def test_a_huge_prompt_is_refused_after_its_first_characters(base_url, path, body, param):
    """Tokenized (on a thread) only as far as it takes to know it is too long: all of it,
    on the event loop, held every other request for seconds (16 MB: 30 s)."""
    response = httpx.post(base_url + path, json=body, timeout=120)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert "The input has at least " in error["message"], error  # not its whole count
    assert httpx.get(base_url + "/health", timeout=10).status_code == 200


@pytest.mark.parametrize("path", ["/generate", "/v1/chat/completions"])
def test_a_client_that_leaves_mid_body_is_no_server_error(server, path):
    """20 of 500 promised bytes, then the connection closes: logged as the client's leaving,
    not as an unexpected error with two tracebacks."""
    host, port = server.base_url.removeprefix("http://").split(":")
    before = len(server.read_log())
    with socket.create_connection((host, int(port)), timeout=10) as connection:
        head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 500\r\n\r\n"
        connection.sendall(head.encode() + b'{"text": "Hi there,')
    deadline = time.monotonic() + 30
    while "left while sending" not in (log := server.read_log()[before:]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert f"a client of {path} left while sending its request" in log
    assert "Traceback" not in log and "ClientDisconnect" not in log
    assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200
