"""The one root of bench's errors. Each tool has its own errors module whose errors derive
from BenchError; a command catches BenchError and prints `pdserve <cmd>: error: <message>`
on one line, exit status 2.

    BenchError
    ├── bench.loadgen.errors.LoadgenError      `bench profile|sweep|compare|loadgen-vs-aiperf`
    │   ├── TokenizerError                     the tokenizer that counts tokens did not load
    │   └── DatasetError                       a trace or artifact file is missing or malformed
    ├── bench.plan.errors.PlanError            `pdserve plan`, `bench calibrate|compare-plan`
    ├── bench.perf.errors.PerfError            benchmarks that start pdserve (soak, kv, ...)
    └── bench.testing.errors.FakeServerError   `bench fake-server`

Errors of the plan file itself (serve.deploy.plan.DeployError, a serve error) reach bench's
commands as PlanError.
"""

from __future__ import annotations


class BenchError(Exception):
    """Root of the errors bench raises on purpose (bad input, a server that would not start)."""
