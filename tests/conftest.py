"""Shared fixtures: real processes on 127.0.0.1, one engine shared by the whole session.

Engines are expensive here (a vLLM AsyncLLM starts its own engine-core process: ~30-70 s
and 3-4 GB on 2 cores), so the aggregated worker and its frontend start once per test
session and every test that needs them shares them.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

# Re-exported: tests import these from here or from tests.helpers.procs.
from tests.helpers.procs import ENGINE_FLAGS, ENGINE_READY_TIMEOUT_S, LOG_DIR, MODEL, ROOT, Proc, free_port  # noqa: F401


# The suite runs under pytest-xdist (`-n auto`, pyproject.toml) with the scheduler below:
# every test in a module that starts real engines (one with an `engine` mark) is one work
# unit, run one after another by a single xdist worker: two vLLM engines at once would not
# fit 2 cores, and that worker starts each session- and module-scoped engine once. Every
# other module is a unit of its own, so a module-scoped server starts once, on one worker.
# (xdist's own `--dist loadgroup` did not keep a group on one worker here: 3.8 split it.)
# A module whose engine-marked tests need the engine stack but start no engine (a model
# conversion, an import of vLLM) says so with a line `STARTS_NO_ENGINE = True`: it is a
# unit of its own, off the engine unit's serial path.
# Unit-test modules that import torch in the test process (vLLM, transformers' AutoTokenizer;
# 3-5 s of CPU each time) say so with `IMPORTS_TORCH = True`: they share one unit, so one
# worker pays for the import once.
ENGINE_UNIT = "engine"
TORCH_UNIT = "imports-torch"
TESTS = Path(__file__).resolve().parent


@functools.lru_cache(maxsize=None)
def _unit_of(module: str) -> str:
    path = TESTS.parent / module
    text = path.read_text() if path.is_file() else ""
    if "mark.engine" in text and "\nSTARTS_NO_ENGINE = True" not in text:
        return ENGINE_UNIT
    return TORCH_UNIT if "\nIMPORTS_TORCH = True" in text else module


# Units handed out first, longest first (the engine unit, then the unit suite's longest
# modules, measured): a long unit started last would leave the other workers idle at the end.
# The rest follow in xdist's order (most tests first). A stale entry costs balance, nothing else.
LONG_UNITS = (ENGINE_UNIT, TORCH_UNIT, "tests/bench/loadgen/test_profile_fake.py",
              "tests/bench/perf/test_first_token.py", "tests/serve/sim/test_cluster.py",
              "tests/serve/sim/test_first_token.py",
              "tests/serve/frontend/test_openai_api.py", "tests/serve/frontend/test_latency_sim.py",
              "tests/serve/frontend/test_routing_sim.py", "tests/serve/frontend/test_fuzz_openai.py",
              "tests/bench/sim/test_scaling.py", "tests/bench/plan/test_grid.py")


# Engine modules run first in the engine unit, before the session's shared engines (the
# aggregated worker, the real disaggregated cluster) start: `pdserve up --mode disagg`
# starts two engines of its own and refuses to start when memory for them is short, as it
# was with three shared engines alive (24 GiB here).
ENGINE_FIRST = ("tests/serve/deploy/test_launcher.py",)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    first = [i for i in items if i.nodeid.split("::", 1)[0] in ENGINE_FIRST]
    if first:
        items[:] = first + [i for i in items if i.nodeid.split("::", 1)[0] not in ENGINE_FIRST]


def pytest_xdist_make_scheduler(config: pytest.Config, log):
    from xdist.scheduler import LoadScopeScheduling

    class EngineUnitScheduling(LoadScopeScheduling):
        _ordered = False

        def _split_scope(self, nodeid: str) -> str:
            return _unit_of(nodeid.split("::", 1)[0])

        def _assign_work_unit(self, node) -> None:
            if not self._ordered:  # the queue is complete at the first assignment
                self._ordered = True
                rank = {unit: i for i, unit in enumerate(LONG_UNITS)}
                units = sorted(self.workqueue.items(), key=lambda u: rank.get(u[0], len(rank)))
                self.workqueue.clear()
                self.workqueue.update(units)
            super()._assign_work_unit(node)

    return EngineUnitScheduling(config, log)


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """One per core (at least 2, at most 8) when engines run: they need the cores. Without
    them (`-m "not engine"`) two per core: the unit suite waits more than it computes (timers,
    child processes starting), so more workers than cores measured faster (60-64 s against
    77-80 s with one per core, on 2 cores)."""
    cores = len(os.sched_getaffinity(0))
    if "not engine" in (config.getoption("markexpr", "") or ""):
        return max(2, min(8, 2 * cores))
    return max(2, min(8, cores))


@pytest.fixture(scope="session")
def model_dir() -> str:
    from serve.model import resolve_model

    return resolve_model(None)


@pytest.fixture(scope="session")
def tokenizer(model_dir: str):
    from serve.frontend.tokenizer import Tokenizer

    return Tokenizer(model_dir)


@pytest.fixture(scope="session")
def agg_worker(model_dir: str) -> Iterator[str]:
    port = free_port()
    proc = Proc("agg-worker", ["worker", "--role", "agg", "--host", "127.0.0.1", "--port", str(port),
                               "--model", model_dir, "--served-model-name", "smollm2-135m-instruct",
                               "--cpu-cores", "0", "--kv-cache-gib", "1", "--max-num-seqs", "32", *ENGINE_FLAGS])
    url = f"http://127.0.0.1:{port}"
    try:
        proc.wait_http(f"{url}/health", ENGINE_READY_TIMEOUT_S)
        yield url
    finally:
        proc.stop()


@pytest.fixture(scope="session")
def frontend(agg_worker: str, model_dir: str) -> Iterator[str]:
    port = free_port()
    proc = Proc("frontend", ["frontend", "--host", "127.0.0.1", "--port", str(port), "--model", model_dir,
                             "--served-model-name", "smollm2-135m-instruct", "--worker", agg_worker])
    url = f"http://127.0.0.1:{port}"
    try:
        proc.wait_http(f"{url}/health", 120)
        yield url
    finally:
        proc.stop()


@pytest.fixture(scope="session")
def real_disagg(model_dir: str, tmp_path_factory):
    """One real disaggregated cluster (frontend + prefill engine + decode engine), started
    once: tests/helpers/realcluster.py. tests/serve/test_faults.py, its last user, breaks it."""
    from tests.helpers.realcluster import start_real_cluster

    c = start_real_cluster(model_dir, tmp_path_factory.mktemp("real-disagg"))
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="session")
def sim_agg(model_dir: str):
    """The real frontend in front of one simulated aggregated worker, in this process (a
    background thread's event loop): `.url` is the frontend, `.urls("agg")[0]` the worker."""
    from tests.helpers.simthread import ThreadedSimCluster

    with ThreadedSimCluster(model_dir, ["agg"], engine_flags=[
            "--max-num-seqs", "64", "--block-size", "16", "--num-gpu-blocks", "4096",
            "--sim-step-model", "constant:0.002"]) as c:
        yield c


@pytest.fixture(scope="session")
def sim_worker(model_dir: str) -> Iterator[str]:
    """One simulated aggregated worker as its own process (`pdserve worker --engine sim`),
    10 ms a step, for tests of the frontend process that need a worker but no real engine."""
    port = free_port()
    proc = Proc("sim-worker", ["worker", "--engine", "sim", "--role", "agg", "--host", "127.0.0.1", "--port",
                               str(port), "--model", model_dir, "--served-model-name", MODEL,
                               "--sim-step-model", "constant:0.01", "--max-num-seqs", "32"])
    url = f"http://127.0.0.1:{port}"
    try:
        proc.wait_http(f"{url}/health", 120)
        yield url
    finally:
        proc.stop()
