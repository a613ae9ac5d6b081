"""A pure ASGI middleware for the checks every request passes: body size, API key, and on
POST a JSON content type from no other site's page.

Pure ASGI rather than FastAPI's `@app.middleware("http")`: that one wraps `receive`, and
a non-streaming route could then no longer see its client disconnect.
"""

from __future__ import annotations

import hmac

from sluice.server.errors import BodyTooLarge, error_response

# The playground page and its files hold nothing secret: it asks for the key itself.
OPEN_PATHS = frozenset({"/health", "/"})
OPEN_PREFIXES = ("/web/",)
# What browsers send as Sec-Fetch-Site for a request from another origin's page (a
# same-origin page, the user's own navigation and non-browser clients send something else).
CROSS_SITE = frozenset({b"cross-site", b"same-site"})
ADMIN_PATHS = frozenset(
    {"/flush_cache", "/abort_request", "/pause_generation", "/continue_generation", "/update_weights_from_disk"}
)


def is_json(content_type: bytes | None) -> bool:
    """Whether a Content-Type header says JSON (application/json, application/*+json, any
    parameters); no header is taken as JSON, as FastAPI takes it."""
    if content_type is None:
        return True
    media_type = content_type.partition(b";")[0].strip().lower()
    kind, _, subtype = media_type.partition(b"/")
    return kind == b"application" and (subtype == b"json" or subtype.endswith(b"+json"))


def bearer_token(authorization: bytes) -> bytes:
    """The key of an `Authorization: Bearer KEY` header (the scheme in any case, as HTTP
    allows), or b"" for any other header: a bare key is not accepted, as in OpenAI's API."""
    scheme, _, token = authorization.strip().partition(b" ")
    return token.strip() if scheme.lower() == b"bearer" else b""


class RequestGuard:
    def __init__(self, app, max_body_bytes: int, api_key: str = "", admin_api_key: str = ""):
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.api_key = api_key.encode()
        self.admin_api_key = admin_api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
            return await self._reject(
                scope, receive, send, 413, f"request body larger than {self.max_body_bytes} bytes"
            )
        required = self._required_keys(scope["path"])
        if required:
            supplied = bearer_token(headers.get(b"authorization", b""))
            # Compare with every accepted key (constant time each), not stopping early.
            matches = [hmac.compare_digest(supplied, key) for key in required]
            if not any(matches):
                return await self._reject(
                    scope, receive, send, 401, "invalid or missing API key: send the header 'Authorization: Bearer KEY'"
                )
        changes_state = scope["method"] == "POST" or scope["path"] in ADMIN_PATHS  # GET /flush_cache too
        if changes_state and (site := headers.get(b"sec-fetch-site")) in CROSS_SITE:
            # A page of another site (or another port of this host) asking here: browsers send
            # a form, text/plain or a typeless body cross-site without asking the server first
            # (and a GET from any <img>), so such a page could pause, flush or drive a server on
            # its user's machine. Browsers say where a request comes from; other clients send
            # nothing.
            method = scope["method"]
            message = f"a {method} from a page of another site is refused (Sec-Fetch-Site: {site.decode('latin-1')})"
            return await self._reject(scope, receive, send, 403, message)
        if scope["method"] == "POST" and not is_json(content_type := headers.get(b"content-type")):
            shown = (content_type or b"").decode("latin-1")  # every POST body is JSON, as FastAPI's are
            message = f"Content-Type must be application/json, got {shown!r}"
            return await self._reject(scope, receive, send, 415, message)
        encoding = headers.get(b"content-encoding", b"identity").decode("latin-1").strip().lower()
        if scope["method"] == "POST" and encoding != "identity":
            # Read as it is, a gzip body was "not valid JSON", and a plain one sent with the
            # header was taken: neither says what was wrong.
            message = f"Content-Encoding {encoding!r} is not supported: send the body uncompressed"
            return await self._reject(scope, receive, send, 415, message)
        return await self.app(scope, self._limited(receive), send)

    def _required_keys(self, path: str) -> list[bytes]:
        """The keys that open `path`; empty when it is open to all."""
        if path in OPEN_PATHS or path.startswith(OPEN_PREFIXES):
            return []
        if path in ADMIN_PATHS and self.admin_api_key:
            return [self.admin_api_key]
        return [key for key in (self.api_key, self.admin_api_key) if key] if self.api_key else []

    def _limited(self, receive):
        """Count a chunked body too, which has no content-length to check up front."""
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise BodyTooLarge(f"request body larger than {self.max_body_bytes} bytes")
            return message

        return limited_receive

    async def _reject(self, scope, receive, send, status_code: int, message: str):
        await error_response(status_code, message)(scope, receive, send)
