"""`pdserve ARGV` in this process, for the commands that bench and serve.deploy add: their
`add_command`, the way serve/cli.py finds them through the `pdserve.commands` entry points,
without depending on the installed entry-point metadata."""

from __future__ import annotations

import argparse

from bench.cli import add_command as add_bench
from bench.plan.cli import add_command as add_plan
from serve.deploy.k8s import add_command as add_k8s


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for add in (add_bench, add_plan, add_k8s):
        add(sub)
    return p


def pdserve(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    return args.run(args)
