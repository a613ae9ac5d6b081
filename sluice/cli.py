"""`sluice serve [flags]`: start the server."""

from __future__ import annotations

import argparse
import sys

from sluice.config import ServerArgs
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
        check_servable(server_args.resolved_model_path())
        check_folder_has_a_tokenizer(server_args.resolved_model_path())
    except (ValueError, OSError) as e:
        sys.exit(f"sluice: {e}")
    from sluice.launch import launch_server

    launch_server(server_args)


if __name__ == "__main__":
    main()
