"""Heap trimming in vLLM's processes (serve.allocator): real glibc, real RSS."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from importlib.metadata import entry_points

import pytest

from serve import allocator


def test_plugin_is_registered_with_vllm():
    # vLLM discovers general plugins by entry point in each of its processes; a stale
    # egg-info in the tree would hide it (tests run from the repository root).
    eps = entry_points(group="vllm.general_plugins")
    assert "pdserve_malloc_trim" in eps.names
    assert eps["pdserve_malloc_trim"].load() is allocator.register


@pytest.mark.parametrize("raw, want", [("", 0.0), ("30", 30.0), ("0", 0.0), ("-5", 0.0), ("soon", 0.0), ("2.5", 2.5)])
def test_interval_from_env(monkeypatch, raw, want):
    monkeypatch.setenv(allocator.ENV, raw)
    assert allocator.interval_from_env() == want


def test_trim_returns_retained_free_chunks_to_the_os():
    # 160 MiB of 4 KiB buffers (below glibc's mmap threshold, so they live in the heap),
    # all freed but the last: the heap's top is pinned, so free() keeps the pages; one
    # trim gives them back.
    script = textwrap.dedent("""
        from serve.allocator import Trimmer, _malloc_trim, _rss_mib
        bufs = [bytearray(4096) for _ in range(40960)]
        keep = bufs[-1]
        del bufs
        before = _rss_mib()
        t = Trimmer(30, _malloc_trim())
        freed = t.trim_once()
        print(f"{before:.1f} {freed:.1f} {t.calls}")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    before, freed, calls = out.stdout.split()
    assert float(freed) > 100, out.stdout
    assert int(calls) == 1


def test_register_starts_one_thread_per_process_only_when_asked():
    script = textwrap.dedent("""
        import os, threading
        from serve import allocator
        def threads():
            return sum(t.name == "pdserve-malloc-trim" for t in threading.enumerate())
        os.environ.pop(allocator.ENV, None)
        allocator.register()
        a = threads()
        os.environ[allocator.ENV] = "30"
        allocator.register(); allocator.register()
        b = threads()
        pid = os.fork()
        if pid == 0:  # vLLM's forked children inherit "plugins loaded": the fork hook starts one
            os._exit(0 if threads() == 1 else 3)
        _, status = os.waitpid(pid, 0)
        print(a, b, os.waitstatus_to_exitcode(status))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["0", "1", "0"], out.stdout + out.stderr
