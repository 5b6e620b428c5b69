"""The offline cluster simulator: its engine's invariants on the virtual clock, the real
router's decisions at scale, faults, and `pdserve sim`'s artifacts (no timing thresholds)."""

from __future__ import annotations

import json
import random
from array import array
import subprocess
import sys

import pytest

from bench.loadgen.config import ProfileConfig
from bench.sim.cluster import OfflineCluster
from bench.sim.flow import Flow, Link
from bench.sim.engine import OfflineEngine, output_token
from bench.sim.loop import Loop
from bench.sim.run import Fault, SimSpec, simulate
from router.hashing import block_hashes
from serve import protocol as p
from serve.frontend.settings import FrontendSettings
from serve.sim.blocks import BlockTable
from serve.sim.engine import SimConfig
from serve.sim.timing import ConstantStep, LinearStep
from tests.conftest import ROOT


def test_engine_keeps_budget_batch_cap_and_block_accounting_under_pressure():
    """Many random requests into a small cache: every step within the token budget and the
    batch cap, blocks never over-committed, preemptions happen, every request finishes with
    its whole answer, and every block is back (held or cached-evictable) at the end."""
    cfg = SimConfig(max_num_seqs=6, num_blocks=40, block_size=16, max_num_batched_tokens=64, max_model_len=512)
    loop = Loop()
    table = BlockTable(cfg.num_blocks, cfg.block_size)
    times: dict[str, array] = {}
    ended: list[str] = []

    def on_token(req):  # the first token and the last
        if req.finished:
            ended.append(req.request_id)

    eng = OfflineEngine(cfg, LinearStep(0.001, 1e-5, 1e-4, 0), table, loop, on_token)
    steps = []
    plain = eng.schedule

    def checked():
        batch = plain()
        assert len(eng.running) <= cfg.max_num_seqs
        assert sum(n for _, n in batch) <= cfg.max_num_batched_tokens
        assert table.used_blocks <= cfg.num_blocks and table.available >= 0
        steps.append(batch)
        return batch

    eng.schedule = checked  # type: ignore[method-assign]
    rng = random.Random(3)
    want = {}
    for i in range(30):
        n, m = rng.randrange(1, 200), rng.randrange(1, 60)
        want[f"r{i}"] = m
        times[f"r{i}"] = eng.token_times[f"r{i}"] = array("d")
        loop.at(rng.random() * 0.05, lambda i=i, n=n, m=m: (
            eng.add(f"r{i}", [1000 + rng.randrange(500) for _ in range(n)], p.SamplingOptions(max_tokens=m, seed=i)),
            eng.kick()))
    loop.run()
    assert {k: len(v) for k, v in times.items()} == want and sorted(ended) == sorted(want)
    assert all(list(v) == sorted(v) for v in times.values())  # token times never go back
    assert eng.counters.preemptions > 0  # the cache was too small for all of them at once
    assert not eng.requests and not eng.running and not eng.waiting
    assert table.used_blocks == 0


def test_output_blocks_enter_the_cache_with_the_hashes_a_full_commit_gives():
    cfg = SimConfig(max_num_seqs=4, num_blocks=64, block_size=8, max_num_batched_tokens=64)
    loop, events = Loop(), []
    table = BlockTable(cfg.num_blocks, cfg.block_size, on_event=events.append)
    eng = OfflineEngine(cfg, ConstantStep(0.01), table, loop, lambda req: None)
    prompt = list(range(1000, 1013))  # 13 tokens: the first output block straddles prompt and answer
    eng.add("a", prompt, p.SamplingOptions(max_tokens=30, seed=5))
    eng.kick()
    hashes = []
    orig = table.free

    def spy(rid):
        hashes.extend(table._seqs[rid].hashes)
        orig(rid)

    table.free = spy  # type: ignore[method-assign]
    loop.run()
    answer = [output_token(5, i) for i in range(30)]
    # Cached: every full block whose KV was computed (the last token's never is).
    assert hashes == block_hashes((prompt + answer)[:-1], 8)
    stored = [h for ev in events for h in getattr(ev, "block_hashes", [])]
    assert stored == hashes


def _spec(roles, **settings) -> SimSpec:
    cfg = SimConfig(max_num_seqs=32, num_blocks=4000, block_size=16, max_num_batched_tokens=2048)
    return SimSpec(roles, cfg, LinearStep(0.002, 2e-5, 1e-4, 1e-8), 16 * 1024, Link(10.0, 0.001),
                   FrontendSettings(model="sim", served_model_name="sim", block_size=16, **settings))


def _cfg(tmp_path, **kw) -> ProfileConfig:
    base = dict(model="sim", url="http://sim", streaming=True, isl=300, osl=20, num_requests=200, concurrency=16,
                random_seed=1, artifact_dir=tmp_path)
    base.update(kw)
    return ProfileConfig(**base)


@pytest.mark.parametrize("mode", ["kv", "round-robin"])
def test_dozens_of_workers_share_a_prefix_heavy_load(tmp_path, mode):
    """32 workers behind the real router: every request split, every prompt token moved to
    its decode worker, the load spread, and in kv mode the shared prefixes reused."""
    roles = ["prefill"] * 24 + ["decode"] * 8
    cfg = _cfg(tmp_path, num_prefix_prompts=4, prefix_prompt_length=256, isl=320, num_requests=400, concurrency=32)
    result, stats = simulate(cfg, _spec(roles, router_mode=mode), progress=False)
    assert len(result.records) == 400 and all(r.ok for r in result.records)
    assert all(r.osl == 20 and len(r.content_ns) == 20 for r in result.records)
    assert result.simulation["paths"] == {"disagg": 400}
    used = [w for w, s in stats["workers"].items() if s["role"] == "prefill" and s["prompt_tokens_computed"]]
    cached = sum(s["prompt_tokens_cached"] for s in stats["workers"].values())
    # Decode workers compute only the prefill's token per request: every prompt token moved.
    assert sum(s["prompt_tokens_computed"] for s in stats["workers"].values() if s["role"] == "decode") == 400
    assert len(used) > 4  # load spreads beyond one worker per prefix
    if mode == "kv":
        # Shared prefixes come back to a worker that holds them: most of each prefix is cached.
        assert cached > 0.5 * 400 * 256


def test_kv_routing_caches_more_than_round_robin(tmp_path):
    roles = ["prefill"] * 16 + ["decode"] * 4
    out = {}
    for mode in ("kv", "round-robin", "random"):
        cfg = _cfg(tmp_path / mode, num_prefix_prompts=8, prefix_prompt_length=256, isl=300, num_requests=300)
        _, stats = simulate(cfg, _spec(roles, router_mode=mode), progress=False)
        w = stats["workers"].values()
        out[mode] = sum(s["prompt_tokens_cached"] for s in w) / sum(
            s["prompt_tokens_cached"] + s["prompt_tokens_computed"] for s in w if s["role"] == "prefill")
    assert out["kv"] > out["round-robin"] and out["kv"] > out["random"], out


def test_losing_decode_workers_fails_only_their_requests_and_the_rest_reroute(tmp_path):
    roles = ["prefill"] * 4 + ["decode"] * 8
    spec = _spec(roles)
    spec.faults = [Fault(1.0, "decode", 4)]
    cfg = _cfg(tmp_path, num_requests=400, concurrency=24, osl=60)
    result, stats = simulate(cfg, spec, progress=False)
    assert len(result.records) == 400
    bad = [r for r in result.records if not r.ok]
    assert bad and all(r.error.code == 502 for r in bad)
    dead = [u for u, s in stats["workers"].items() if not s["alive"]]
    assert len(dead) == 4
    # After the poller noticed, no request went to a dead worker: the late ones all succeed.
    late = sorted(result.records, key=lambda r: r.start_ns)[-100:]
    assert all(r.ok for r in late)


def test_a_prefill_worker_lost_mid_prefill_falls_back_to_the_decode_worker(tmp_path):
    roles = ["prefill"] * 1 + ["decode"] * 2
    spec = _spec(roles)
    spec.faults = [Fault(0.05, "prefill", 1)]
    cfg = _cfg(tmp_path, num_requests=40, concurrency=8, isl=2000)
    result, _ = simulate(cfg, spec, progress=False)
    assert all(r.ok for r in result.records), [r.error for r in result.records if not r.ok][:3]
    paths = result.simulation["paths"]
    assert paths.get("fallback", 0) + paths.get("no-prefill-worker", 0) > 0, paths
    assert paths.get("no-prefill-worker", 0) > 0  # after the poller took it out of rotation


def test_admission_refuses_beyond_the_queue_with_429(tmp_path):
    spec = _spec(["agg"] * 2, max_active_requests=4, max_queued_requests=4)
    cfg = _cfg(tmp_path, num_requests=100, concurrency=None, request_rate=10000.0, arrival="constant")
    result, _ = simulate(cfg, spec, progress=False)
    codes = {r.error.code for r in result.records if not r.ok}
    ok = [r for r in result.records if r.ok]
    assert codes == {429} and len(ok) >= 8


def test_multi_turn_sessions_find_their_history_in_the_cache(tmp_path):
    spec = _spec(["agg"] * 4)
    cfg = _cfg(tmp_path, num_requests=None, num_sessions=20, session_turns=4, isl=100, osl=40, concurrency=8)
    result, stats = simulate(cfg, spec, progress=False)
    assert len(result.records) == 80 and all(r.ok for r in result.records)
    by = {(r.session, r.turn): r for r in result.records}
    # Turn k's prompt is turn k-1's prompt and answer plus 100 new tokens.
    assert all(by[(s, t)].isl == by[(s, t - 1)].isl + 40 + 100 for s in range(20) for t in range(1, 4))
    cached = sum(s["prompt_tokens_cached"] for s in stats["workers"].values())
    assert cached > 0.5 * sum(by[(s, t - 1)].isl + 40 for s in range(20) for t in range(1, 4))


def test_pdserve_sim_writes_simulated_artifacts_that_bench_compare_reads(tmp_path):
    a, b = tmp_path / "agg", tmp_path / "disagg"
    common = ["--sim-system", "h100_sxm", "--isl", "1000", "--osl", "50", "--concurrency", "8",
              "--num-requests", "60", "--ui-type", "none", "--block-size", "64"]
    for out, layout in ((a, ["--mode", "agg", "--workers", "2"]),
                        (b, ["--mode", "disagg", "--prefill", "1", "--decode", "1", "--network", "tcp"])):
        proc = subprocess.run([sys.executable, "-m", "serve.cli", "sim", *layout, *common, "--artifact-dir", str(out)],
                              cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "SIMULATED" in proc.stdout
        doc = json.loads((out / "profile_export_aiperf.json").read_text())
        assert doc["simulated"] is True and doc["request_count"]["avg"] == 60
        assert doc["simulation"]["step_model"]["source"] == "planner"
        assert (out / "sim_workers.json").is_file() and (out / "sim_series.jsonl").read_text().count("\n") >= 1
        assert json.loads((out / "sim_profile.json").read_text())["format"] == "pdserve.profile/1"
    cmp = subprocess.run([sys.executable, "-m", "serve.cli", "bench", "compare", str(a), str(b)], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert cmp.returncode == 0, cmp.stderr
    assert "(SIMULATED)" in cmp.stdout and "time_to_first_token" in cmp.stdout


@pytest.mark.parametrize("argv, message", [
    (["--kill", "x"], "--kill 'x': T:ROLE:N"),
    (["--kill", "1:prefill:1"], "no prefill workers"),
    (["--sim-system", "nope"], "unknown system 'nope'"),
    (["--sim-profile", "/nonexistent.json"], "/nonexistent.json"),
    (["--frobnicate-engine"], "unrecognized arguments"),
])
def test_bad_options_are_one_line_errors(argv, message, capsys):
    from serve.cli import main

    try:
        rc = main(["sim", "--isl", "10", "--osl", "2", "--num-requests", "1", "--ui-type", "none", *argv])
    except SystemExit as exc:  # argparse's own refusals
        rc = exc.code
    err = capsys.readouterr().err
    assert rc == 2 and message in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) <= 2  # usage line + the error


def test_every_flow_ends_even_when_nothing_can_serve_it(tmp_path):
    loop = Loop()
    settings = FrontendSettings(model="sim", served_model_name="sim", block_size=16)
    cluster = OfflineCluster(loop, settings, ["agg"], SimConfig(num_blocks=4, block_size=16), ConstantStep(0.01),
                             1024, Link())
    done: list[Flow] = []
    cluster.submit(Flow("big", 0, 0, list(range(1000, 1200)), 10, 1, 0.0, done.append))  # cannot fit 4 blocks
    loop.run()
    assert len(done) == 1 and done[0].error[0] == 400


def test_the_decode_waits_for_the_read_of_the_held_blocks():
    """A split request's second token comes after the READ of every held block: the prefill
    worker holds them until then (bytes over the link's bandwidth plus its latency)."""
    loop = Loop()
    settings = FrontendSettings(model="sim", served_model_name="sim", block_size=16)
    cfg = SimConfig(num_blocks=100, block_size=16, max_num_batched_tokens=512)
    cluster = OfflineCluster(loop, settings, ["prefill", "decode"], cfg, ConstantStep(0.005), 10**6, Link(1.0, 0.002))
    pw = next(w for w in cluster.workers.values() if w.role == "prefill")
    held = []
    loop.at(0.0101, lambda: held.append(pw.table.used_blocks))  # after the prefill's token, before the READ ends
    done: list[Flow] = []
    cluster.submit(Flow("r", 0, 0, list(range(1000, 1200)), 4, 1, 0.0, done.append))
    loop.run()
    (flow,) = done
    blocks = -(-200 // 16)
    read = 0.002 + blocks * 10**6 / 1e9
    assert flow.error is None and held == [blocks]
    assert flow.times[1] - flow.times[0] >= read  # the READ, then the decode's first step
    assert pw.table.used_blocks == 0  # freed once read


def test_killing_a_decode_worker_not_yet_contacted_only_reroutes(tmp_path):
    """Requests still prefilling elsewhere lose nothing when their planned decode worker dies:
    their hand-off finds it unreachable and takes the next one (the frontend's retry)."""
    roles = ["prefill", "decode", "decode"]
    spec = _spec(roles)
    spec.step_model = LinearStep(0.001, 1e-3, 1e-4, 0)  # 2,000-token prompts take ~2 s each to prefill
    spec.faults = [Fault(0.5, "decode", 1)]
    cfg = _cfg(tmp_path, num_requests=4, concurrency=4, isl=2000, osl=10)
    result, _ = simulate(cfg, spec, progress=False)
    assert [r.ok for r in result.records] == [True] * 4, [r.error for r in result.records]


def test_a_queue_that_fails_at_once_ends_without_recursion():
    loop = Loop()
    settings = FrontendSettings(model="sim", served_model_name="sim", block_size=16)
    cluster = OfflineCluster(loop, settings, ["agg"], SimConfig(num_blocks=1000, block_size=16), ConstantStep(0.01),
                             1024, Link())
    done: list[Flow] = []
    for i in range(1024):  # 512 served, 512 queued
        cluster.submit(Flow(f"r{i}", i, 0, list(range(1000, 1020)), 50, i, 0.0, done.append))
    loop.at(0.001, cluster.kill, "http://sim-agg-0:8100")
    loop.run()
    assert len(done) == 1024 and all(f.error is not None for f in done)
    assert {f.error[0] for f in done} <= {502, 503}


def test_open_loop_arrivals_are_the_ones_bench_profile_draws(tmp_path):
    """Same seed, same arrivals: a simulation and a real `bench profile` run of one workload
    send their requests at the same offsets (the client's own random stream and gaps)."""
    from bench.loadgen.runner import arrival_rng, next_gap

    for arrival in ("poisson", "gamma", "constant"):
        cfg = _cfg(tmp_path / arrival, concurrency=None, request_rate=5.0, arrival=arrival, arrival_smoothness=2.0,
                   num_requests=25, random_seed=7)
        result, _ = simulate(cfg, _spec(["agg"] * 4), progress=False)
        starts = sorted(r.start_ns for r in result.records)
        offsets = [(s - starts[0]) / 1e9 for s in starts]
        rng, t, want = arrival_rng(7), 0.0, []
        for _ in range(25):
            want.append(t)
            t += next_gap(arrival, 5.0, 2.0, rng)
        assert offsets == pytest.approx(want, abs=1e-6), arrival


def test_a_simulation_draws_the_workload_shape_bench_profile_draws(tmp_path, model_dir):
    """Same seed, same shape: each request's ISL and OSL, and its shared prefix, are the ones
    a real `bench profile` run of the same flags sends (so a simulation and a real run compare
    request for request); only the text differs (token ids offline)."""
    from bench.loadgen.dataset import PlanBuilder, PromptBuilder
    from bench.loadgen.tokenizer import load_tokenizer
    from bench.sim.workload import build_sessions

    cfg = _cfg(tmp_path, model=model_dir, isl=200, isl_stddev=60, osl=40, osl_stddev=10, num_requests=30,
               num_prefix_prompts=3, prefix_prompt_length=64, random_seed=11, warmup_requests=2)
    _, real = PlanBuilder(cfg, PromptBuilder(load_tokenizer(model_dir, model_dir), cfg.endpoint_type)).build()
    sim = build_sessions(cfg)
    assert [(s.turns[0].isl, s.turns[0].osl) for s in real] == [(t.isl, t.osl) for s in sim for t in s.turns]


def test_the_same_seed_gives_the_same_simulation(tmp_path):
    """Ties between equally good workers are broken from a stream seeded by --random-seed:
    two runs of one workload give the same answer, request for request."""
    roles = ["prefill"] * 6 + ["decode"] * 3
    runs = []
    for i in range(2):
        cfg = _cfg(tmp_path / str(i), isl=200, isl_stddev=50, num_requests=120, concurrency=12, random_seed=5)
        result, _ = simulate(cfg, _spec(roles), progress=False)
        runs.append(sorted((r.start_ns, list(r.content_ns)) for r in result.records))  # virtual times
    assert runs[0] == runs[1]
