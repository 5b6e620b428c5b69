"""Step-time profiles (pdserve.profile/1): the step formula, the file's checks, and the
simulated worker's flags that use them (no sockets, no sleeps)."""

from __future__ import annotations

import json

import pytest

from serve.errors import ConfigError
from serve.sim import profile
from serve.sim.config import parse_sim_options
from serve.sim.engine import SimRequest

DOC = {"format": "pdserve.profile/1", "source": {"kind": "measured"}, "system": "box", "kv_bytes_per_token": 1024,
       "step": {"overhead_s": 0.001, "tokens": [[1, 0.002], [100, 0.003], [1000, 0.012]],
                "prefill_attention_s_per_pair": 1e-9, "decode_attention_s_per_context_token": 1e-7},
       "transfer": {"bandwidth_gbps": 2.0, "latency_s": 0.0005}}


def test_step_is_overhead_plus_tokens_plus_attention_per_request():
    s = profile.from_dict(DOC)
    # 2 decodes at contexts 100 and 300, one chunk of 50 new tokens after 200 computed: 52 tokens.
    tokens = 0.002 + (0.003 - 0.002) * (52 - 1) / 99
    pairs = 50 * 200 + 50 * 51 / 2
    want = 0.001 + tokens + 1e-7 * 400 + 1e-9 * pairs
    assert s.step_seconds([100, 300], [(200, 50)]) == pytest.approx(want)
    # Past the last point: the last segment's slope; no work: the overhead only.
    assert s.tokens_seconds(2000) == pytest.approx(0.012 + 0.009 / 900 * 1000)
    assert s.step_seconds([], []) == 0.001
    assert s.transfer == profile.Transfer(2.0, 0.0005) and s.kv_bytes_per_token == 1024


@pytest.mark.parametrize("change, message", [
    ({"format": "x/1"}, "format 'x/1'"),
    ({"step": None}, "no 'step' object"),
    ({"step": {"tokens": []}}, "non-empty list"),
    ({"step": {"tokens": [[0, 1.0]]}}, "integer >= 1"),
    ({"step": {"tokens": [[1, -1.0]]}}, "must be a number >= 0"),
    ({"step": {"tokens": [[1, 1.0], [1, 2.0]]}}, "repeated token counts"),
    ({"transfer": {"bandwidth_gbps": 0}}, "bandwidth_gbps must be > 0"),
])
def test_a_bad_profile_is_one_line_naming_the_field(change, message):
    with pytest.raises(profile.ProfileError, match=message):
        profile.from_dict({**DOC, **change}, "p.json")


def test_worker_flags_take_a_profile_and_its_link_speedup_and_start_up(tmp_path):
    f = tmp_path / "p.json"
    f.write_text(json.dumps(DOC))
    o = parse_sim_options(["--sim-profile", str(f), "--sim-speedup", "4", "--sim-startup-s", "2"], None, 1.0)
    assert isinstance(o.step_model, profile.ProfileStep)
    assert (o.kv_bandwidth_gbps, o.kv_latency_s, o.startup_s, o.engine.speedup) == (2.0, 0.0005, 2.0, 4.0)
    # The link flags win over the profile's; the step times are divided by the speed-up.
    o2 = parse_sim_options(["--sim-profile", str(f), "--sim-kv-bandwidth-gbps", "9", "--sim-kv-latency-ms", "1",
                            "--sim-speedup", "4"], None, 1.0)
    assert (o2.kv_bandwidth_gbps, o2.kv_latency_s) == (9.0, 0.001)
    from serve.sim.blocks import BlockTable
    from serve.sim.engine import SimEngine
    from serve.sim.tokens import Vocabulary

    eng = SimEngine(o2.engine, Vocabulary((5,), None, 10), o2.step_model, BlockTable(10, 16))
    req = SimRequest("r", [1] * 10, None, b"", in_prefill=False, output=[2])  # type: ignore[arg-type]
    assert eng.step_time([(req, 1)]) == pytest.approx(o2.step_model.step_seconds([11], []) / 4)


@pytest.mark.parametrize("argv, message", [
    (["--sim-profile", "/nope.json"], "--sim-profile /nope.json"),
    (["--sim-profile", "x.json", "--sim-step-model", "constant"], "one step-time source"),
    (["--sim-speedup", "0"], "--sim-speedup must be > 0"),
    (["--sim-startup-s", "-1"], "--sim-startup-s must be >= 0"),
    (["--sim-kv-latency-ms", "-1"], "--sim-kv-latency-ms must be >= 0"),
])
def test_bad_worker_flags_are_config_errors(argv, message):
    with pytest.raises(ConfigError, match=message):
        parse_sim_options(argv, None, 1.0)
