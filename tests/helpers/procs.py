"""pdserve processes the tests start: `Proc` runs `python -m serve.cli ...` in its own
process group with its output in a log file (serve.common.procs.Child underneath)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from serve.common.procs import Child

ROOT = Path(__file__).resolve().parents[2]
ENGINE_READY_TIMEOUT_S = 420.0
LOG_DIR = Path(os.environ.get("PDSERVE_TEST_LOGS", "/tmp/pdserve-test-logs"))
MODEL = "smollm2-135m-instruct"


def fast_16bit_cpu(cpuinfo: str | None = None) -> bool:
    """x86 with AVX-512 or AMX, where vLLM's 16-bit CPU kernels are fast (serve.engine's
    `cpu_avx512_or_amx`, read from /proc/cpuinfo's flags so that no test imports torch for it).
    A machine without a /proc/cpuinfo counts as fast: nothing is changed there."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return True
    flags = next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")), None)
    return flags is None or "avx512f" in flags or "amx_tile" in flags


# Engine flags for the engines whose answers tests compare with each other (the aggregated
# worker, the real disaggregated cluster). On an AVX2-only CPU vLLM's bf16 kernels prefill at
# ~30 tokens/s on one core (a 3,840-token prompt took 126 s, past the frontend's timeouts;
# CI failed on it), float32 ~5x faster; AVX-512 machines keep the model's bf16.
ENGINE_FLAGS: list[str] = [] if fast_16bit_cpu() else ["--dtype", "float32"]


def free_port(count: int = 1) -> int:
    """A port for a server a test starts (it binds seconds later): below the ephemeral range;
    with `count`, the first of that many consecutive free ports (a launcher's workers)."""
    from serve.listen import late_port

    return late_port("127.0.0.1", count)


class Proc(Child):
    """`pdserve ARGS` as a child in its own process group, logging to LOG_DIR."""

    def __init__(self, name: str, args: list[str], env: dict[str, str] | None = None,
                 wrapper: list[str] | None = None, pass_fds: tuple[int, ...] = ()) -> None:
        log_path = LOG_DIR / f"{name}-{os.getpid()}-{time.time_ns()}.log"
        cmd = [*(wrapper or []), sys.executable, "-m", "serve.cli", *args]
        super().__init__(name, cmd, log_path, env={**os.environ, **(env or {})}, cwd=ROOT, pass_fds=pass_fds)
