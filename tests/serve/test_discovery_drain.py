"""Frontend discovery through DNS (dns+http) and the drain wait, without engines."""

from __future__ import annotations

import asyncio
import time

import pytest

from serve import discovery
from serve.cli import main
from serve.drain import wait_idle


def test_plain_urls_pass_through():
    assert asyncio.run(discovery.expand("http://10.0.0.7:8000/")) == ["http://10.0.0.7:8000"]


def test_dns_url_expands_to_every_address():
    urls = asyncio.run(discovery.expand("dns+http://localhost:8123"))
    assert "http://127.0.0.1:8123" in urls
    assert all(u.endswith(":8123") for u in urls) and len(urls) == len(set(urls))
    assert asyncio.run(discovery.expand("dns+http://127.0.0.1:9")) == ["http://127.0.0.1:9"]
    assert asyncio.run(discovery.expand("dns+http://[::1]:9")) == ["http://[::1]:9"]


def test_unresolvable_name_gives_no_url():
    assert asyncio.run(discovery.expand("dns+http://pdserve-no-such-host.invalid:8000")) == []


@pytest.mark.parametrize("bad", ["ftp://x:1", "dns+ftp://x:1", "pdserve-frontend:8000", "dns+http://:8000"])
def test_bad_frontend_urls_are_refused(bad, capsys):
    with pytest.raises(ValueError):
        discovery.check(bad)
    assert main(["worker", "--frontend", bad]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pdserve worker: error: --frontend") and len(err.strip().splitlines()) == 1


def test_wait_idle_returns_when_idle_or_at_the_timeout():
    left = [3]

    def active() -> int:
        left[0] = max(0, left[0] - 1)
        return left[0]

    idle, waited = asyncio.run(wait_idle(active, timeout_s=10))
    assert idle and waited < 5
    t0 = time.monotonic()
    idle, waited = asyncio.run(wait_idle(lambda: 1, timeout_s=0.3))
    assert not idle and 0.3 <= waited < 2 and time.monotonic() - t0 >= 0.3
    idle, waited = asyncio.run(wait_idle(lambda: 0, timeout_s=5, settle_s=0.2))
    assert idle and waited >= 0.2


def test_drain_and_model_wait_fail_in_one_line(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    import importlib

    import huggingface_hub.constants

    importlib.reload(huggingface_hub.constants)
    try:
        cases = [(["drain", "--url", "http://127.0.0.1:9"], "pdserve drain: error: http://127.0.0.1:9"),
                 (["drain", "--timeout", "-1"], "must be >= 0"),
                 (["model", "wait", "acme/absent", "--timeout", "0"], "pdserve-model-cache Job"),
                 (["model", "download", "./local-dir"], "not a hub id")]
        for argv, text in cases:
            assert main(argv) == 2, argv
            err = capsys.readouterr().err
            assert text in err and len(err.strip().splitlines()) == 1, (argv, err)
        # a completed download is what `model wait` sees
        from serve.model import download_marker, model_present

        assert not model_present("acme/absent")
        download_marker("acme/absent").parent.mkdir(parents=True)
        download_marker("acme/absent").write_text("{}")
        assert main(["model", "wait", "acme/absent", "--timeout", "0"]) == 0
    finally:
        monkeypatch.delenv("HF_HOME")
        importlib.reload(huggingface_hub.constants)
