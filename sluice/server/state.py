"""What every route shares: the server's arguments, the TokenizerManager once it is
started, and whether the server is ready. Both the native and the OpenAI routes import it."""

from __future__ import annotations

from sluice.tokenizer.manager import TokenizerManager


class ServerState:
    def __init__(self, server_args, tokenizer_manager: TokenizerManager | None = None):
        self.server_args = server_args
        self.model_name = server_args.model_name()
        self.tm = tokenizer_manager
        self.ready = tokenizer_manager is not None

    def unavailable(self) -> str | None:
        if not self.ready:
            return "the server is starting"
        return self.tm.backend_error or self.tm.health_error
