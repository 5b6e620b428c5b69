"""The `pdserve` command: dispatch only, one subcommand per role or tool.

Each role's settings object owns its flags (`WorkerSettings`, `FrontendSettings`,
`UpSettings`: `add_arguments` / `from_args`). The tools that live outside `serve`
(`pdserve bench`, `pdserve plan`) and `pdserve k8s` are found through the entry-point group
`pdserve.commands`: each entry is `add_command(subparsers)`, which adds its parser and sets
`run` on it. So `serve` never imports `bench`. Heavy imports (vLLM, torch) happen inside the
subcommand that needs them. Every failure the user can fix is one line on stderr, exit 2.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from importlib.metadata import entry_points

from serve import drain_client, flags, model_command
from serve.autoscale import cli as autoscale_cli
from serve.deploy.launcher import UpSettings
from serve.errors import PdserveError
from serve.frontend.settings import FrontendSettings
from serve.worker.settings import WorkerSettings

COMMAND_GROUP = "pdserve.commands"
log = logging.getLogger("pdserve.cli")


def _worker(args: argparse.Namespace, passthrough: list[str]) -> int:
    from serve.worker import main

    return main.run(WorkerSettings.from_args(args), passthrough)


def _frontend(args: argparse.Namespace) -> int:
    from serve.frontend import main

    return main.run(args)


def _up(args: argparse.Namespace) -> int:
    from serve.deploy import launcher

    return launcher.run(args)


def plugin_commands() -> list[Callable[[argparse._SubParsersAction], None]]:
    """`add_command` of each entry point in `pdserve.commands`, first of each name."""
    seen: dict[str, Callable] = {}
    for ep in entry_points(group=COMMAND_GROUP):
        if ep.name not in seen:
            seen[ep.name] = ep.load()
    return [seen[name] for name in sorted(seen)]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="Prefill/decode disaggregated LLM serving on vLLM.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    w = sub.add_parser(
        "worker", help="run one vLLM engine as a worker",
        description="Run one worker process owning one vLLM AsyncLLM engine. Options not listed here are "
                    "vLLM engine arguments and are passed through verbatim (e.g. --max-num-seqs 16 "
                    "--kv-cache-dtype fp8 --max-model-len 4096 --tensor-parallel-size 1).")
    WorkerSettings.add_arguments(w)
    w.set_defaults(run_known=_worker)
    f = sub.add_parser("frontend", help="run the OpenAI-compatible frontend")
    FrontendSettings.add_arguments(f)
    f.set_defaults(run=_frontend)
    u = sub.add_parser("up", help="start a frontend and workers on this machine")
    UpSettings.add_arguments(u)
    u.set_defaults(run=_up)
    for add_command in plugin_commands():
        add_command(sub)
    a = sub.add_parser("autoscale", help="size the prefill and decode (or agg) pools to TTFT and ITL targets",
                       description="The SLA autoscaler: observes frontends and workers each interval, predicts TTFT "
                                   "and ITL for candidate pool sizes from the workers' step profile, decides with "
                                   "hysteresis, and explains (GET /autoscaler, /metrics).")
    autoscale_cli.add_arguments(a)
    a.set_defaults(run=autoscale_cli.run)
    d = sub.add_parser("drain", help="take a frontend or worker out of rotation and wait for its requests "
                                     "(a Kubernetes preStop hook)")
    drain_client.add_arguments(d)
    d.set_defaults(run=drain_client.run_client)
    m = sub.add_parser("model", help="prepare models")
    model_command.add_arguments(m)
    m.set_defaults(run=model_command.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    if argv and argv[0] == "worker":
        args, passthrough = parser.parse_known_args(argv)
    else:
        args, passthrough = parser.parse_args(argv), []
    if args.command is None:
        parser.print_help()
        return 2
    if hasattr(args, "log_level"):
        flags.setup_logging(args.log_level)
    try:
        if getattr(args, "run_known", None) is not None:
            return args.run_known(args, passthrough)
        if getattr(args, "run", None) is None:
            parser.error(f"unknown command {args.command}")
        return args.run(args)
    except PdserveError as exc:
        print(f"pdserve {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
