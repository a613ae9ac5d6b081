"""What every route shares: the server's arguments, the TokenizerManager once it is
started, and whether the server is ready. Both the native and the OpenAI routes import it."""

from __future__ import annotations

from sluice.config import ServerArgs
from sluice.server.logprobs import TokenTexts
from sluice.tokenizer.control import BackendError
from sluice.tokenizer.manager import TokenizerManager


class ServerState:
    def __init__(self, server_args: ServerArgs) -> None:
        self.server_args = server_args
        self.model_name = server_args.model_name()
        self._tm: TokenizerManager | None = None
        self._token_texts = TokenTexts()

    def serve_with(self, tm: TokenizerManager) -> None:
        """The TokenizerManager is started: the routes may use it."""
        self._tm = tm

    @property
    def ready(self) -> bool:
        return self._tm is not None

    @property
    def tm(self) -> TokenizerManager:
        # The HTTP server serves only after the lifespan started it; a route that ran
        # earlier would get the same 503 as /health.
        if self._tm is None:
            raise BackendError("the server is starting")
        return self._tm

    @property
    def token_texts(self) -> TokenTexts:
        """The text of single tokens, which logprobs name, by the tokenizer now served."""
        self._token_texts.bind(self.tm.tokenizer)
        return self._token_texts

    def unavailable(self) -> str | None:
        if self._tm is None:
            return "the server is starting"
        return self._tm.backend_error or self._tm.health_error
