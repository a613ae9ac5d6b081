"""`sluice serve [flags]`: start the server."""

from __future__ import annotations

import argparse
import errno
import os
import socket
import sys

from sluice.config import CACHE_DIR_ENV, ServerArgs, cache_root
from sluice.model.model_config import check_servable
from sluice.tokenizer_files import check_folder_has_a_tokenizer


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sluice", description="sluice: an LLM serving runtime")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve a model over HTTP (native and OpenAI APIs)")
    ServerArgs.add_cli_args(serve)
    return parser


def main(argv: list[str] | None = None) -> None:
    ns = build_parser().parse_args(argv)
    try:
        server_args = ServerArgs.from_cli_args(ns)
        check_surroundings(server_args)
        check_servable(server_args.resolved_model_path())
        check_folder_has_a_tokenizer(server_args.resolved_model_path())
    except (ValueError, OSError) as e:
        sys.exit(f"sluice: {e}")
    from sluice.launch import launch_server

    launch_server(server_args)


def check_surroundings(server_args: ServerArgs) -> None:
    """ValueError naming what the flags and the environment ask of this machine that it cannot
    give, before the model loads: the address to listen on, the cache folder, the threads,
    the local media folder."""
    cpus = len(os.sched_getaffinity(0))
    threads = server_args.num_threads * server_args.dp_size
    if threads > cpus:
        replicas = f" x --dp-size {server_args.dp_size}" if server_args.dp_size > 1 else ""
        raise ValueError(
            f"--num-threads {server_args.num_threads}{replicas} is more than the {cpus} CPUs this process may "
            "run on (threads past them only wait on each other)"
        )
    media = server_args.allowed_local_media_path
    if media and not os.path.isdir(media):
        raise ValueError(f"--allowed-local-media-path {media!r} is not a folder")
    try:
        cache = cache_root()
        cache.mkdir(parents=True, exist_ok=True)
    except (OSError, RuntimeError) as e:  # RuntimeError: no home folder to put it in
        raise ValueError(f"cannot make sluice's cache folder (set {CACHE_DIR_ENV} to choose it): {e}") from None
    check_can_listen(server_args.host, server_args.port)


def check_can_listen(host: str, port: int) -> None:
    """ValueError where --host/--port cannot be listened on (in use, not this machine's), found
    now rather than once the model has loaded. The HTTP server binds again itself. Like
    uvicorn, every address the host name gives is tried, and one not on this machine passed
    over while another is."""
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ValueError(f"--host {host!r}: {e.strerror}") from None
    error: OSError | None = None
    bound = 0
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as listener:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn and granian bind
            try:
                listener.bind(address)
                bound += 1
            except OSError as e:
                if e.errno != errno.EADDRNOTAVAIL:
                    raise ValueError(f"cannot listen on --host {host} --port {port}: {e.strerror}") from None
                error = e
    if not bound and error is not None:
        raise ValueError(f"cannot listen on --host {host} --port {port}: {error.strerror}")


if __name__ == "__main__":
    main()
