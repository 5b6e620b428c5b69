"""How benchmarks start and stop their servers (serve.common.procs underneath): ready on a
health URL, a server that dies first is a PerfError naming the log, stop ends the group."""

from __future__ import annotations

import sys

import pytest

from bench.perf.errors import PerfError
from bench.perf.servers import Servers, free_port, pdserve, url_of
from serve.common import procs


def test_ready_then_stopped_with_its_group(tmp_path):
    port = free_port()
    with open(tmp_path / "servers.log", "wb") as log:
        servers = Servers(log, grace_s=10)
        child = servers.serve("http", [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
                              f"{url_of(port)}/", timeout=60)
        assert procs.alive(child.pid)
        servers.stop()
        assert child.poll() is not None and servers.children == []


def test_a_server_that_exits_is_one_error_naming_its_log(tmp_path):
    log_path = tmp_path / "servers.log"
    with open(log_path, "wb") as log, Servers(log) as servers:
        with pytest.raises(PerfError) as e:
            servers.serve("broken", [sys.executable, "-c", "raise SystemExit(3)"], f"{url_of(free_port())}/health",
                          timeout=30)
    msg = str(e.value)
    assert msg.startswith("broken: ") and "status 3" in msg and str(log_path) in msg and "\n" not in msg


def test_pdserve_command_line():
    assert pdserve("worker", "--role", "agg")[1:] == ["-m", "serve.cli", "worker", "--role", "agg"]
