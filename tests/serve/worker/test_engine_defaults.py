"""The vLLM flags pdserve adds on CPU, and that a user's own choice always wins."""

from serve.engine import with_cpu_defaults


def test_cpu_defaults_added_when_unset():
    assert with_cpu_defaults(["--max-num-seqs", "8"]) == [
        "--enforce-eager", "--no-enable-chunked-prefill", "--max-num-seqs", "8"]


def test_user_choices_win():
    assert with_cpu_defaults(["--enable-chunked-prefill"]) == ["--enforce-eager", "--enable-chunked-prefill"]
    assert with_cpu_defaults(["--enable-chunked-prefill=false"]) == ["--enforce-eager",
                                                                     "--enable-chunked-prefill=false"]
    assert with_cpu_defaults(["-O3"]) == ["--no-enable-chunked-prefill", "-O3"]
    assert with_cpu_defaults(["--no-enforce-eager", "--no-enable-chunked-prefill"]) == [
        "--no-enforce-eager", "--no-enable-chunked-prefill"]


def test_kv_event_endpoints_stay_private_on_loopback(tmp_path, monkeypatch):
    import os
    import shutil
    import stat
    import tempfile

    from serve.flags import is_loopback_host as _is_loopback
    from serve.worker.sockets import ipc_endpoint as _ipc_endpoint

    assert _is_loopback("127.0.0.1") and _is_loopback("::1") and _is_loopback("[::1]") and _is_loopback("localhost")
    assert not _is_loopback("0.0.0.0") and not _is_loopback("10.0.0.7") and not _is_loopback("pdserve-prefill")
    short = tempfile.mkdtemp(prefix="pd-", dir="/tmp")  # tmp_path is too deep for a socket path
    try:
        monkeypatch.setenv("XDG_RUNTIME_DIR", short)
        a, b = _ipc_endpoint("kv-events-1"), _ipc_endpoint("kv-events-1")
        assert a.startswith(f"ipc://{short}/pdserve-{os.getuid()}/kv-events-1-") and a != b
        assert stat.S_IMODE(os.stat(f"{short}/pdserve-{os.getuid()}").st_mode) == 0o700
    finally:
        shutil.rmtree(short)
    # A runtime directory too deep for a Unix socket path (107 bytes) is passed over.
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / ("d" * 90)))
    c = _ipc_endpoint("kv-events-1")
    assert len(c) - len("ipc://") <= 100 and "d" * 90 not in c


def test_sockets_of_dead_workers_are_swept(tmp_path):
    import os
    import subprocess
    import sys

    from serve.worker.sockets import sweep_dead_sockets as _sweep_dead_sockets

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True).stdout.strip()
    names = [f"kv-events-1-{dead}-abc123.sock", f"kv-events-2-{os.getpid()}-def456.sock", "notes.txt"]
    for n in names:
        (tmp_path / n).write_text("")
    _sweep_dead_sockets(str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[1:])



def test_fp8_kv_on_a_cpu_without_avx512_or_amx_is_refused_before_the_engine_starts():
    """vLLM's CPU attention stores fp8 KV only with AVX-512 or AMX; without them vLLM fails
    after loading the weights, so the worker says so first, in one line
    (`parse_engine_args` calls this with vLLM's platform and the CPU's flags)."""
    import pytest

    from serve.engine import check_kv_cache_dtype
    from serve.errors import ConfigError

    def never():
        raise AssertionError("asked about the CPU when it does not matter")

    for dtype in ("fp8", "fp8_e4m3", "fp8_e5m2"):
        with pytest.raises(ConfigError, match=f"--kv-cache-dtype {dtype}: .*AVX-512 or AMX.*--kv-cache-dtype auto"):
            check_kv_cache_dtype(dtype, True, lambda: False)
        check_kv_cache_dtype(dtype, True, lambda: True)
        check_kv_cache_dtype(dtype, False, never)  # a GPU's fp8 is vLLM's to judge
    for dtype in ("auto", "bfloat16"):
        check_kv_cache_dtype(dtype, True, never)


def test_a_16_bit_model_on_a_cpu_without_avx512_or_amx_gets_a_dtype_hint():
    from serve.engine import slow_cpu_hint

    def never():
        raise AssertionError("asked about the CPU when it does not matter")

    for dtype in ("auto", "bfloat16", "float16"):
        assert "--dtype float32" in slow_cpu_hint(dtype, True, lambda: False)
        assert slow_cpu_hint(dtype, True, lambda: True) is None
        assert slow_cpu_hint(dtype, False, never) is None
    assert slow_cpu_hint("float32", True, never) is None
