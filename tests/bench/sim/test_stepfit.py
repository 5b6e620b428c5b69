"""`pdserve bench calibrate --steps`: the step model fitted to engine step records recovers a
known profile from its own steps, and reads a live simulated worker's `GET /steps`."""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bench.sim.errors import SimError
from bench.sim.stepfit import fit, nnls, read_steps
from serve.sim.cluster import SimCluster
from serve.sim.profile import ProfileStep, from_dict
from tests.conftest import ROOT
from tests.serve.sim.test_cluster import complete

TRUE = ProfileStep(overhead_s=0.004, token_points=((16, 0.001), (256, 0.004), (2048, 0.030), (8192, 0.125)),
                   prefill_pair_s=2e-9, decode_context_s=5e-8)


def batches(n: int, seed: int = 3) -> list[tuple[list[int], list[list[int]]]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        decodes = [rng.randint(50, 3000) for _ in range(rng.choice([0, 1, 4, 16, 48]))]
        prefills = [[rng.choice([0, 0, 512]), rng.randint(16, 3000)] for _ in range(rng.choice([0, 0, 1, 2]))]
        if decodes or prefills:
            out.append((decodes, prefills))
    return out


def test_nnls_matches_an_exact_non_negative_solution_and_clips_a_negative_one():
    a = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    assert nnls(a, np.array([1.0, 2.0, 3.0])) == pytest.approx([1.0, 2.0])
    assert nnls(a, np.array([1.0, -2.0, -1.0])) == pytest.approx([0.0, 0.0], abs=1e-9)  # unclipped: (0.67, -1.33)
    assert nnls(a, np.array([2.0, -1.0, 1.0])) == pytest.approx([1.5, 0.0])


def test_the_fit_recovers_a_known_profile_from_its_steps():
    steps = [(TRUE.step_seconds(d, [tuple(c) for c in p]) * random.Random(i).uniform(0.98, 1.02), d, p)
             for i, (d, p) in enumerate(batches(600))]
    step, report = fit(steps)
    assert step.overhead_s == pytest.approx(TRUE.overhead_s, rel=0.2)
    assert step.decode_context_s == pytest.approx(TRUE.decode_context_s, rel=0.15)
    assert step.prefill_pair_s == pytest.approx(TRUE.prefill_pair_s, rel=0.15)
    assert all(b[1] >= a[1] for a, b in zip(step.token_points, step.token_points[1:]))  # never decreasing
    # Steps it never saw (another seed) are predicted within a few percent.
    for d, p in batches(200, seed=9):
        chunks = [tuple(c) for c in p]
        assert step.step_seconds(d, chunks) == pytest.approx(TRUE.step_seconds(d, chunks), rel=0.06)
    assert report["steps"] == len(steps) and report["relative_error"]["mixed"]["p90"] < 0.05


def test_too_few_steps_and_bad_records_are_one_line_errors(tmp_path):
    with pytest.raises(SimError, match="at least 8"):
        fit([(0.01, [5], [])] * 3)
    bad = tmp_path / "steps.jsonl"
    bad.write_text('{"t": 1, "s": 0.1, "d": [1], "p": []}\n{"t": 2}\n')
    with pytest.raises(SimError, match="steps.jsonl:2: not a step record"):
        read_steps(str(bad))


def test_calibrate_reads_a_live_simulated_workers_steps_and_says_they_are_simulated(model_dir, tmp_path):
    profile = tmp_path / "true.json"
    profile.write_text(json.dumps(TRUE.to_dict(source={"kind": "test"}, system="t", kv_cache_dtype="auto",
                                               model="m")))

    async def run() -> tuple[str, list]:
        async with SimCluster(model_dir, ["agg"], engine_flags=["--sim-profile", str(profile), "--sim-speedup", "50",
                                                               "--max-num-seqs", "8"]) as c:
            prompts = [" ".join(f"w{i}x{j}" for j in range(10 + 40 * i)) for i in range(6)]
            await asyncio.gather(*(complete(c, q, 12) for q in prompts))
            url = c.urls("agg")[0]
            out = tmp_path / "fitted.json"
            # The CLI in a subprocess, against this live worker (no cluster token in the test cluster).
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "serve.cli", "bench", "calibrate", "--steps", url, "--out", str(out), cwd=ROOT,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            stdout, stderr = await asyncio.wait_for(proc.communicate(), 120)
            assert proc.returncode == 0, stderr.decode()[-2000:]
            steps = (await c.client.get(f"{url}/steps")).json()["steps"]
            return stdout.decode(), steps

    stdout, steps = asyncio.run(run())
    assert "SIMULATED steps" in stdout
    doc = json.loads((tmp_path / "fitted.json").read_text())
    assert doc["format"] == "pdserve.profile/1" and doc["source"]["kind"] == "measured"
    assert doc["source"]["simulated"] is True and doc["kv_bytes_per_token"] > 0
    fitted = from_dict(doc)
    # The worker slept the profile's time / 50: the fit explains every step it recorded.
    for s in steps:
        chunks = [tuple(c) for c in s["p"]]
        assert fitted.step_seconds(s["d"], chunks) == pytest.approx(s["s"], rel=0.05)


def test_steps_past_the_knot_table_extend_it():
    long = [(TRUE.step_seconds([], [(0, n)]), [], [[0, n]]) for n in (100_000, 150_000, 90_000, 120_000)]
    steps = [(TRUE.step_seconds(d, [tuple(c) for c in p]), d, p) for d, p in batches(60)] + long
    step, report = fit(steps)
    assert report["max_step_tokens"] == 150_000 and step.token_points[-1][0] >= 150_000
    assert len({k for k, _ in step.token_points}) == len(step.token_points)  # no repeated knot


def test_one_prompt_length_and_few_batch_sizes_leave_tokens_linear_and_pairs_to_what_is_needed():
    """What `bench.plan.cpucheck` records on a CPU: decodes of 1 and 4 sequences and 256-token
    prompts (alone, or three at once), every prompt one length, so attention pairs are a fixed
    multiple of tokens. Such steps cannot tell the two terms apart, nor what a step of 16
    decodes costs; the weak priors make tokens() a straight line where no step bends it and
    leave the prompts' cost to the linear layers. Before them the fit put every prompt's cost
    in pairs, kept tokens() flat from 8 to 256 and priced 16 decodes as 8 (-42% on the CPU
    check's concurrency 16)."""
    true = ProfileStep(overhead_s=0.035, token_points=((1024, 1024 * 0.026),), prefill_pair_s=0.0,
                       decode_context_s=3e-5)  # compute-bound from one token: 26 ms a token
    rng = random.Random(5)
    shapes = [([300], []), ([300] * 4, []), ([], [[0, 256]]), ([300], [[0, 256]] * 3)]
    steps = [(true.step_seconds(d, [tuple(c) for c in p]) * rng.uniform(0.97, 1.03), d, p)
             for d, p in (shapes[rng.choice([0, 0, 1, 1, 2, 3])] for _ in range(400))]
    step, _ = fit(steps)
    for decodes in (8, 16, 64):  # batch sizes it never saw
        assert step.step_seconds([300] * decodes, []) == pytest.approx(true.step_seconds([300] * decodes, []), rel=0.1)
    assert step.prefill_pair_s * 256 * 257 / 2 < 0.05 * step.step_seconds([], [(0, 256)])
    # A prompt of another length, from the tokens alone.
    assert step.step_seconds([], [(0, 128)]) == pytest.approx(true.step_seconds([], [(0, 128)]), rel=0.1)


def test_prompts_priced_per_token_past_the_largest_step_when_decodes_dominate_the_records():
    """The calibration steps of a CPU check on a 2-core AVX-512 EPYC (2026-12-08, `python -m
    bench.plan.cpucheck`, its `steps.json` as [seconds, decode contexts, prefill chunks]): 882
    decode steps of 1 and 4 sequences (25-29 ms: weight-bound, a decode's seconds per token is
    ~30x a prompt's) and 14 steps with 256-token prompts (one, two or three at once, ~210 ms a
    prompt). The smoothing prior's scale came from every step's seconds per token, a decode's,
    and was then 30x too weak: tokens() bent steep to 512 tokens and flat to 1024, so 8 prompts
    cost what 4 did (the check's c8 and c16 TTFT -62% and -82%)."""
    data = json.loads((Path(__file__).parent / "data" / "cpucheck_avx512_steps.json").read_text())
    step, report = fit([(s, d, p) for s, d, p in data])
    assert report["steps"] == 901 and report["max_step_tokens"] == 769
    one, two, three, four, eight = (step.step_seconds([], [(0, 256)] * n) for n in (1, 2, 3, 4, 8))
    assert 0.18 < one < 0.27  # what the steps say: ~210 ms a prompt, alone or with others
    assert two / one > 1.8 and three / one > 2.6
    assert four / one > 3.2 and eight / four > 1.7  # past the largest step: still per token (was 2.7 and 1.0)
