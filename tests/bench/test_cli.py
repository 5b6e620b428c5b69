"""`pdserve bench|plan`: the commands serve/cli.py discovers (`add_command` sets `run`), the
error tree under one root, and one line on stderr, exit 2, for any BenchError."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from bench.errors import BenchError
from bench.loadgen.errors import DatasetError, LoadgenError, TokenizerError
from bench.perf.errors import PerfError
from bench.plan.errors import PlanError
from bench.testing.errors import FakeServerError
from tests.bench.commands import parser, pdserve
from tests.conftest import ROOT


def test_every_tool_error_has_the_one_root():
    for err in (LoadgenError, TokenizerError, DatasetError, PlanError, PerfError, FakeServerError):
        assert issubclass(err, BenchError)


def test_add_command_sets_run_on_every_command():
    import bench.cli
    import bench.plan.cli

    p = parser()
    assert p.parse_args(["bench", "soak"]).run is bench.cli.run
    assert p.parse_args(["bench", "fake-server"]).run is bench.cli.run
    assert p.parse_args(["plan", "--model", "m", "--system", "s", "--total-gpus", "1", "--isl", "1", "--osl", "1",
                         "--ttft", "1", "--tpot", "1"]).run is bench.plan.cli.run_plan


def one_line_error(capsys, argv: list[str], prefix: str) -> str:
    assert pdserve(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{prefix}: error: ") and len(err.strip().splitlines()) == 1, err
    return err


def test_bench_errors_are_one_line(capsys, tmp_path):
    (tmp_path / "bad.json").write_text('{"schema": "other"}')
    err = one_line_error(capsys, ["bench", "compare-plan", str(tmp_path / "bad.json"), str(tmp_path)],
                         "pdserve bench compare-plan")
    assert "not a pdserve.plan/1 plan" in err
    one_line_error(capsys, ["bench", "engine-memory", "--capacities", "x", "--out", str(tmp_path / "em")],
                   "pdserve bench engine-memory")
    one_line_error(capsys, ["bench", "compare", str(tmp_path / "a"), str(tmp_path / "b")], "pdserve bench compare")
    one_line_error(capsys, ["bench", "calibrate", str(tmp_path)], "pdserve bench calibrate")
    one_line_error(capsys, ["bench"], "pdserve bench")
    err = one_line_error(capsys, ["bench", "frontend-overhead", "--aiperf", str(tmp_path / "no-aiperf")],
                         "pdserve bench frontend-overhead")
    assert "make aiperf" in err
    err = one_line_error(capsys, ["bench", "frontend-overhead", "--client", "pdserve", "--profile-concurrency", "16",
                                  "--py-spy", str(tmp_path / "no-py-spy")], "pdserve bench frontend-overhead")
    assert "make py-spy" in err


def test_plan_errors_are_one_line(capsys, tmp_path):
    err = one_line_error(capsys, ["plan", "--model", "smollm2-135m-instruct", "--system", "tpu_v9", "--total-gpus",
                                  "1", "--isl", "10", "--osl", "10", "--ttft", "100", "--tpot", "10", "--save-dir",
                                  str(tmp_path)], "pdserve plan")
    assert "unknown system 'tpu_v9'" in err


def test_plan_writes_its_artifacts(capsys, tmp_path):
    assert pdserve(["plan", "--model", "nvidia/Llama-3.1-Nemotron-Nano-4B-v1.1", "--system", "h200_sxm",
                    "--total-gpus", "4", "--isl", "4000", "--osl", "500", "--ttft", "600", "--tpot", "16.67",
                    "--save-dir", str(tmp_path)]) == 0
    assert "winner: aggregated" in capsys.readouterr().out
    for f in ("plan.json", "agg_best.csv", "disagg_best.csv", "pareto.csv", "pareto.png", "launch.sh"):
        assert (tmp_path / f).stat().st_size > 0, f


@pytest.mark.parametrize("old, new", [("bench.disagg_bench", "bench.perf.disagg_bench"),
                                      ("bench.frontend_overhead", "bench.perf.frontend_overhead"),
                                      ("bench.router.micro", "bench.perf.router_micro")])
def test_the_readmes_module_paths_run_the_moved_code(old, new):
    import importlib

    assert importlib.import_module(old).main is importlib.import_module(new).main


def test_router_micro_runs_from_its_old_path():
    r = subprocess.run([sys.executable, "-m", "bench.router.micro", "--workers", "4", "--blocks", "200",
                        "--tokens", "512", "--iters", "20"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert '"decision_p50_us"' in r.stdout


def test_pyprojects_entry_points_name_these_add_commands():
    import importlib
    import tomllib

    eps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["pdserve.commands"]
    assert set(eps) == {"bench", "plan", "k8s", "sim"}
    for name, target in eps.items():
        module, _, attr = target.partition(":")
        sub = argparse.ArgumentParser(prog="pdserve").add_subparsers(dest="command")
        getattr(importlib.import_module(module), attr)(sub)
        assert callable(sub.choices[name].get_default("run")), name


def test_sigterm_unwinds_a_benchmark_so_it_stops_its_servers():
    """`timeout` or a CI runner stops a benchmark with SIGTERM: its `finally` (Servers.stop)
    still runs, instead of leaving the engines it started behind."""
    code = ("import os, signal, time, bench.cli\n"
            "bench.cli._stop_on_sigterm()\n"
            "try:\n    os.kill(os.getpid(), signal.SIGTERM)\n    time.sleep(30)\n"
            "finally:\n    print('servers stopped', flush=True)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 143 and r.stdout.strip() == "servers stopped", (r.returncode, r.stdout, r.stderr)
