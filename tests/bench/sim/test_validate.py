"""`python -m bench.sim.validate`'s fidelity check (the real-engine runs themselves are the
benchmark's): the error is against the mean of the two real runs, and the tolerance is
max(15%, 1.5 x their spread)."""

from __future__ import annotations

import pytest

from bench.sim.validate import METRICS, compare, table


def _run(**kw) -> dict[str, float]:
    base = {"ttft_p50": 100.0, "ttft_p90": 200.0, "itl_p50": 50.0, "itl_p90": 60.0, "output_tps": 20.0}
    return {**base, **kw}


def test_error_is_against_the_real_mean_and_tolerance_widens_with_the_repeat_spread():
    real = [_run(ttft_p50=90.0, ttft_p90=100.0), _run(ttft_p50=110.0, ttft_p90=300.0)]
    f = compare(real, _run(ttft_p50=120.0, ttft_p90=150.0, itl_p50=60.0))
    assert set(f) == {m for m, _, _ in METRICS}
    assert f["ttft_p50"]["real"] == 100.0 and f["ttft_p50"]["error"] == pytest.approx(0.2)
    assert f["ttft_p50"]["spread"] == pytest.approx(0.2) and f["ttft_p50"]["tolerance"] == pytest.approx(0.3)
    assert f["ttft_p50"]["ok"] is True  # 20% within 1.5 x 20%
    assert f["ttft_p90"]["spread"] == pytest.approx(1.0) and f["ttft_p90"]["ok"] is True  # -25% within 150%
    assert f["itl_p50"]["tolerance"] == 0.15 and f["itl_p50"]["ok"] is False  # +20%, the runs agreed
    assert f["output_tps"]["error"] == 0.0 and f["output_tps"]["ok"] is True
    text = table({"points": {"agg1 fixed 30%": {"rate": 0.3, "fidelity": f}}})
    assert "| agg1 fixed 30% | 0.300 |" in text and text.count("**miss**") == 1
