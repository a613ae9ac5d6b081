"""Run the app under the chosen HTTP server: uvicorn (default) or Granian."""

from __future__ import annotations

from sluice.config import ServerArgs


def serve_http(server_args: ServerArgs, app, workers: int = 1) -> None:
    """`app` is the app itself (one worker) or an import string of an app factory."""
    if server_args.http_server == "granian":
        _serve_granian(server_args, app, workers)
        return
    import uvicorn

    uvicorn.run(
        app,
        host=server_args.host,
        port=server_args.port,
        log_level="warning",
        timeout_keep_alive=30,
        workers=workers if workers > 1 else None,
        factory=isinstance(app, str),
    )


def _serve_granian(server_args: ServerArgs, app_factory: str, workers: int) -> None:
    from granian import Granian
    from granian.constants import Interfaces
    from granian.log import LogLevels

    Granian(
        app_factory,
        address=server_args.host,
        port=server_args.port,
        interface=Interfaces.ASGI,
        workers=workers,
        factory=True,
        log_level=LogLevels.warning,
    ).serve()
