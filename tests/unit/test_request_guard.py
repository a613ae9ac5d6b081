"""RequestGuard, the checks every request passes: only `Authorization: Bearer KEY` opens a
route, the admin key opens the admin routes, /health is open to all; a body larger than
--max-request-body-bytes is refused with 413, declared or chunked."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import pytest
from fastapi import FastAPI, Request

from sluice.server.errors import install_error_handlers
from sluice.server.guard import RequestGuard

API_KEY, ADMIN_KEY = "api-key-1", "admin-key-2"


async def ok_app(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


@asynccontextmanager
async def guarded(**keys) -> AsyncIterator[httpx.AsyncClient]:
    """A client whose requests pass a RequestGuard (1 KiB bodies, `keys`) on their way to ok_app."""
    guard = RequestGuard(ok_app, max_body_bytes=1024, **keys)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=guard), base_url="http://guard") as client:
        yield client


async def status(path: str, authorization: str | None, **keys) -> int:
    headers = {"Authorization": authorization} if authorization is not None else {}
    async with guarded(**keys) as client:
        return (await client.get(path, headers=headers)).status_code


@pytest.mark.parametrize(
    "authorization, expected",
    [
        (None, 401),
        (API_KEY, 401),  # a bare key, without the scheme
        (f"Basic {API_KEY}", 401),
        (f"Bearer{API_KEY}", 401),
        ("Bearer wrong", 401),
        ("Bearer ", 401),
        (f"Bearer {API_KEY}", 200),
        (f"bearer {API_KEY}", 200),  # the scheme is case-insensitive in HTTP
        (f"  Bearer   {API_KEY}  ", 200),
        (f"Bearer {ADMIN_KEY}", 200),  # the admin key opens every route
    ],
)
async def test_only_a_bearer_key_opens_a_route(authorization, expected):
    assert await status("/generate", authorization, api_key=API_KEY, admin_api_key=ADMIN_KEY) == expected


@pytest.mark.parametrize(
    "authorization, expected",
    [
        (ADMIN_KEY, 401),
        (f"Bearer {API_KEY}", 401),
        (f"Bearer {ADMIN_KEY}", 200),
    ],
)
async def test_admin_routes_need_the_admin_key_as_bearer(authorization, expected):
    assert await status("/flush_cache", authorization, api_key=API_KEY, admin_api_key=ADMIN_KEY) == expected


async def test_an_admin_key_alone_guards_only_the_admin_routes():
    assert await status("/generate", None, admin_api_key=ADMIN_KEY) == 200
    assert await status("/abort_request", ADMIN_KEY, admin_api_key=ADMIN_KEY) == 401
    assert await status("/abort_request", f"Bearer {ADMIN_KEY}", admin_api_key=ADMIN_KEY) == 200


async def test_health_is_open_and_the_refusal_says_how_to_send_the_key():
    assert await status("/health", None, api_key=API_KEY) == 200
    async with guarded(api_key=API_KEY) as client:
        error = (await client.get("/v1/models", headers={"Authorization": API_KEY})).json()["error"]
    assert error["type"] == "AuthenticationError" and "Authorization: Bearer KEY" in error["message"]


# ------------------------------------------------------------------ body size


def sized_app(max_body_bytes: int) -> FastAPI:
    """A route that reads its body, behind the guard and the app's error handlers."""
    app = FastAPI()
    install_error_handlers(app)
    app.add_middleware(RequestGuard, max_body_bytes=max_body_bytes)

    @app.post("/echo")
    async def echo(request: Request):
        return {"size": len(await request.body())}

    return app


async def post(app, content, headers: dict[str, str] | None = None) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://guard") as client:
        return await client.post("/echo", content=content, headers=headers)


async def test_a_body_within_the_limit_reaches_the_route():
    response = await post(sized_app(1024), b"x" * 1024)
    assert response.status_code == 200 and response.json() == {"size": 1024}


async def test_a_declared_length_over_the_limit_is_refused_before_the_route():
    response = await post(sized_app(1024), b"x" * 1025)
    assert response.status_code == 413
    error = response.json()["error"]
    assert error["type"] == "RequestTooLarge" and error["message"] == "request body larger than 1024 bytes"


async def test_a_length_that_is_not_a_number_is_refused():
    response = await post(sized_app(1024), b"{}", headers={"content-length": "12abc"})
    assert response.status_code == 413


async def test_a_chunked_body_is_counted_as_it_arrives():
    async def pieces():
        for _ in range(5):
            yield b"x" * 300

    response = await post(sized_app(1024), pieces())  # no content-length: chunked
    assert response.status_code == 413
    assert response.json()["error"]["message"] == "request body larger than 1024 bytes"


async def test_other_scopes_pass_through_untouched():
    seen = []

    async def app(scope, receive, send):
        seen.append(scope["type"])

    await RequestGuard(app, max_body_bytes=1, api_key=API_KEY)({"type": "lifespan"}, None, None)
    assert seen == ["lifespan"]


@pytest.mark.parametrize(
    "content_type, expected",
    [
        (None, 200),  # no header: JSON, as FastAPI takes it
        ("application/json", 200),
        ("Application/JSON; charset=utf-8", 200),
        ("application/merge-patch+json", 200),
        ("text/plain", 415),  # what a cross-site form or fetch may send without asking
        ("application/x-www-form-urlencoded", 415),
        ("multipart/form-data; boundary=x", 415),
        ("text/json", 415),
        ("application/jsonx", 415),
    ],
)
async def test_a_post_body_must_be_json(content_type, expected):
    headers = {"Content-Type": content_type} if content_type is not None else {}
    async with guarded() as client:
        response = await client.post("/pause_generation", content=b"{}", headers=headers)
        assert response.status_code == expected
        if expected == 415:
            assert f"must be application/json, got {content_type!r}" in response.json()["error"]["message"]
        # A GET has no body to check.
        assert (await client.get("/get_server_info", headers=headers)).status_code == 200


@pytest.mark.parametrize(
    "site, expected", [("cross-site", 403), ("same-site", 403), ("same-origin", 200), ("none", 200), (None, 200)]
)
async def test_a_post_from_another_sites_page_is_refused(site, expected):
    """Even typeless (a no-cors fetch of raw bytes sends no Content-Type and no preflight)."""
    headers = {"Sec-Fetch-Site": site} if site is not None else {}
    async with guarded() as client:
        response = await client.post("/pause_generation", content=b"", headers=headers)
        assert response.status_code == expected
        if expected == 403:
            assert response.json()["error"]["type"] == "PermissionDeniedError"
        assert (await client.get("/get_server_info", headers=headers)).status_code == 200  # reading is not posting
