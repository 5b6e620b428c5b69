"""`pdserve frontend`: from settings to a serving process."""

from __future__ import annotations

import argparse
import socket

from serve import flags, listen
from serve.frontend.settings import FrontendSettings


def run(args: argparse.Namespace) -> int:
    from serve.model import resolve_model, served_name

    settings = FrontendSettings.from_args(args, resolve_model(args.model),
                                          args.served_model_name or served_name(args.model))
    flags.warn_open("frontend", args.host, args.cluster_token, "register a worker")
    if args.listen_fd is not None:  # bound by `pdserve up` before it started the workers
        sock = socket.socket(fileno=args.listen_fd)
    else:
        sock = listen.bind(args.host, args.port)
    from serve.frontend.app import build_app

    return listen.serve(build_app(settings), sock, log_level=args.log_level,
                        graceful_timeout_s=settings.graceful_timeout_s)
