"""`pdserve bench engine-memory`: argument checks and the heap samples it reads from a
worker's log (the lines serve.allocator writes)."""

import logging

import pytest

from bench.perf.engine_memory import LINE, _capacities
from bench.perf.errors import PerfError
from serve.allocator import Trimmer


def test_capacities_parse_and_refuse_bad_values():
    assert _capacities("1024,128") == [1024, 128]
    for bad in ("x", "", "-1", "128,,y"):
        with pytest.raises(PerfError, match="--capacities must be integers"):
            _capacities(bad)


def test_reads_the_trimmer_log_line(caplog, monkeypatch):
    monkeypatch.setenv("PDSERVE_MALLOC_TRIM_VERBOSE", "1")
    with caplog.at_level(logging.INFO, logger="vllm.pdserve.allocator"):
        Trimmer(15, lambda pad: 1).trim_once()
    line = "(Worker pid=4242) INFO 12-01 17:35:55 [allocator.py:88] " + caplog.records[-1].getMessage()
    pid, rss, heap, calls = (int(x) for x in LINE.search(line).groups())
    assert pid == 4242 and calls == 1 and rss > 0 and heap > 0
