"""Prefill engine -> NIXL READ -> decode engine, with real engines in separate processes.

The decode worker pulls (`--kv-transfer-mode pull`): every other real-engine disaggregated
test (test_disagg_e2e.py, test_faults.py, test_netns.py) runs the default, auto, which is
push on this machine's shm and tcp transports, so both modes move real KV between engines.

Greedy output through the transfer must equal the same engine running the request alone,
the KV must really move (bytes = blocks x block bytes, the decode engine computes at most
the last partial block), and blocks must come back on both sides after aborts and leases.
"""

from __future__ import annotations

import math

import httpx
import pytest

from tests.helpers.procs import ENGINE_FLAGS, MODEL, Proc, free_port
from tests.helpers.workerclient import generate, metric, metrics, reset_prefix_cache, wait_for

pytestmark = pytest.mark.engine

# Long enough that a transfer the test means to succeed is not lost to a stalled engine: the
# suite runs other tests beside this module (xdist) on two cores, and on CI one of fourteen
# reads in a row once came after a 4 s lease had expired. The expiry test waits it out once.
LEASE_S = 10.0
BLOCK = 128
# Block edges (127/128/129, 255/256/257), one token, and long prompts; not all multiples in between
# (each prompt costs a prefill, a decode and a cold run alone).
LENGTHS = [1, 77, 127, 128, 129, 255, 256, 257, 383, 777, 1000, 1999]


def start_worker(role: str, core: int, model_dir: str, extra: list[str], wait: bool = True) -> tuple[Proc, str]:
    port = free_port()
    proc = Proc(f"{role}-worker", ["worker", "--role", role, "--port", str(port), "--model", model_dir,
                                   "--served-model-name", MODEL, "--cpu-cores", str(core), "--kv-cache-gib", "1",
                                   "--max-num-seqs", "8", "--max-model-len", "4096",
                                   "--kv-lease-seconds", str(LEASE_S), *extra])
    url = f"http://127.0.0.1:{port}"
    if wait:
        proc.wait_http(f"{url}/health", 420)
    return proc, url


def machine_kv_dtype() -> str:
    """fp8, the product's KV format, where vLLM's CPU backend can store it (x86 with AVX-512
    or AMX); elsewhere the engines' own dtype (float32 on such a CPU, tests/helpers/procs.py's
    ENGINE_FLAGS: in bf16 this module alone took 406 s there), so the transfer is still
    checked end to end on every machine. bf16 transfers are exercised by every disaggregated
    test on AVX-512 machines (test_disagg_e2e.py and test_faults.py compare their answers with
    the aggregated engine's). A second pair of engines for the other dtype cost this suite ~80 s."""
    from serve.engine import cpu_avx512_or_amx

    if cpu_avx512_or_amx():
        return "fp8"
    return "fp32" if "float32" in ENGINE_FLAGS else "bf16"


@pytest.fixture(scope="module")
def pair(model_dir):
    kind = machine_kv_dtype()
    extra = ["--kv-cache-dtype", "fp8"] if kind == "fp8" else ENGINE_FLAGS
    procs = []
    try:
        p, purl = start_worker("prefill", 0, model_dir, extra, wait=False)
        procs.append(p)
        d, durl = start_worker("decode", 1, model_dir, [*extra, "--kv-transfer-mode", "pull"], wait=False)
        procs.append(d)
        for proc, url in ((p, purl), (d, durl)):  # both engines load at once
            proc.wait_http(f"{url}/health", 420)
        info = httpx.get(f"{durl}/info", timeout=10).json()
        assert info["kv_transfer_mode"] == "pull", info
        yield kind, purl, durl, d
    finally:
        for proc in procs:
            proc.stop()


def prompts(tokenizer) -> list[list[int]]:
    """Token-exact prompts cut from one long, regular text (a counting list), each starting
    at a line start, so greedy continuations have clear margins (a near-tie could flip on
    bf16 rounding between a 1-token step and a full prefill, which is not a transfer
    error). Lengths are not multiples of the block size; two share a long prefix."""
    lines = [f"Step {i}: add one to {i} and get {i + 1}." for i in range(1, 400)]
    starts, ids = [], []
    for line in lines:
        starts.append(len(ids))
        ids += tokenizer.encode(line + "\n", add_special_tokens=False)
    assert len(ids) > 4000
    out = [ids[starts[i * 3]: starts[i * 3] + n] for i, n in enumerate(LENGTHS)]
    # Two prompts sharing a long prefix with an earlier one (prompt 10: 1000 tokens).
    out.append(out[10][:700] + ids[starts[300]: starts[300] + 60])
    out.append(out[10][:640] + ids[starts[320]: starts[320] + 133])
    return out


def expected_blocks(ps: list[list[int]]) -> list[int]:
    """Blocks each decode must read: its prompt's blocks minus full blocks already in the
    decode engine's prefix cache from earlier transfers (same leading full blocks)."""
    seen: set[tuple[int, ...]] = set()
    out = []
    for ids in ps:
        full = len(ids) // BLOCK
        hits = 0
        while hits < full and tuple(ids[: (hits + 1) * BLOCK]) in seen:
            hits += 1
        if hits * BLOCK >= len(ids):  # vLLM always computes the last token
            hits -= 1
        out.append(math.ceil(len(ids) / BLOCK) - hits)
        seen.update(tuple(ids[: (b + 1) * BLOCK]) for b in range(full))
    return out


def transfer_log(text: str) -> list[str]:
    """The decode worker's per-load lines (each READ with its blocks, each failure with its
    reason, each slow acquire with its handshake and queueing times)."""
    kinds = ("kvtransfer: read ", "kvtransfer: load of ", "kvtransfer: acquire of ", "kvtransfer: handshake ")
    return [line.split("kvtransfer: ", 1)[1] for line in text.splitlines() if any(k in line for k in kinds)]


def block_bytes(kind: str) -> int:
    layers, kv_heads, head_dim = 30, 3, 64
    return layers * kv_heads * BLOCK * head_dim * 2 * {"fp8": 1, "bf16": 2, "fp32": 4}[kind]


def test_transfer_matches_engine_alone_and_moves_the_kv(pair, tokenizer):
    kind, purl, durl, dproc = pair
    ps = prompts(tokenizer)
    assert len(ps) >= 14 and sorted({len(p) for p in ps}) == sorted({len(p) for p in ps})
    # One transfer first, outside the counts: the pair's handshake and both engines' first
    # steps. Its prompt is under a block, so it leaves nothing in the decode's prefix cache.
    warm = tokenizer.encode("Hello there, warm-up.", add_special_tokens=False)
    assert len(warm) < BLOCK
    loads = ("pdserve_kv_reads_total", "pdserve_kv_transfer_failures_total")
    w0 = metrics(durl)
    pre = generate(purl, warm, max_tokens=1, remote_decode=True, request_id=f"pre-warm-{kind}")
    assert pre.error is None and pre.kv_transfer is not None, pre
    assert generate(durl, warm, max_tokens=2, kv_transfer=pre.kv_transfer, request_id=f"dec-warm-{kind}").error is None
    wait_for(lambda: sum(metric(metrics(durl), k) - metric(w0, k) for k in loads) >= 1, 10,
             "the warm-up's load counted by the decode worker")
    wait_for(lambda: held_blocks(purl) == 0, LEASE_S + 10, "the warm-up's hold released")
    d0 = metrics(durl)
    via_transfer = []
    for i, ids in enumerate(ps):
        pre = generate(purl, ids, max_tokens=1, remote_decode=True, request_id=f"pre-{kind}-{i}")
        assert pre.error is None and pre.kv_transfer is not None, pre
        assert len(pre.kv_transfer["block_ids"]) == math.ceil(len(ids) / BLOCK)
        dec = generate(durl, ids, max_tokens=12, kv_transfer=pre.kv_transfer, request_id=f"dec-{kind}-{i}")
        assert dec.error is None, dec
        assert dec.tokens[0] == pre.tokens[0]  # the prefill's first token agrees
        via_transfer.append(dec.tokens)
    # The engine reports its connector's counters with a step's output: wait (bounded) for
    # every load to be counted, read or failed, before comparing.
    wait_for(lambda: sum(metric(metrics(durl), k) - metric(d0, k) for k in loads) >= len(ps), 10,
             f"{len(ps)} loads counted by the decode worker")
    d1 = metrics(durl)
    # The worker's own account, for the messages below: its failures and slow acquires first
    # (pytest cuts a long message, and CI shows only the message).
    log = transfer_log(dproc.log_path.read_text())
    log = [x for x in log if x.startswith(("load of", "acquire of"))] + [x for x in log if x.startswith("read ")]
    assert metric(d1, "pdserve_kv_transfer_failures_total") == metric(d0, "pdserve_kv_transfer_failures_total"), log
    assert metric(d1, "pdserve_kv_recomputes_total") == metric(d0, "pdserve_kv_recomputes_total"), log
    assert metric(d1, "pdserve_kv_reads_total") - metric(d0, "pdserve_kv_reads_total") == len(ps), log

    want_blocks = expected_blocks(ps)
    assert metric(d1, "pdserve_kv_blocks_transferred_total") - metric(d0, "pdserve_kv_blocks_transferred_total") \
        == sum(want_blocks), (want_blocks, log)
    assert metric(d1, "pdserve_kv_bytes_transferred_total") - metric(d0, "pdserve_kv_bytes_transferred_total") \
        == sum(want_blocks) * block_bytes(kind)
    # No silent recompute: the decode engine computed at most the last partial block of each prompt.
    computed = (metric(d1, "vllm:prompt_tokens_by_source_total", source="local_compute")
                - metric(d0, "vllm:prompt_tokens_by_source_total", source="local_compute"))
    assert computed <= sum(min(len(ids) % BLOCK or BLOCK, BLOCK) for ids in ps)

    # The same engine running each request alone (cold prefix cache each time).
    differ = []
    for i, ids in enumerate(ps):
        reset_prefix_cache(durl)
        alone = generate(durl, ids, max_tokens=12, request_id=f"alone-{kind}-{i}")
        if via_transfer[i] != alone.tokens:
            differ.append((i, len(ids), via_transfer[i], alone.tokens))
    assert differ == [], f"{len(differ)} of {len(ps)} prompts differ: {differ}"


def held_blocks(url: str) -> float:
    return metric(metrics(url), "pdserve_kv_held_blocks")


def kv_usage(url: str) -> float:
    return httpx.get(f"{url}/load", timeout=10).json()["kv_usage"]


def test_expired_lease_frees_blocks_and_decode_recomputes_correctly(pair, tokenizer):
    kind, purl, durl, _ = pair
    ids = prompts(tokenizer)[8]
    nblocks = math.ceil(len(ids) / BLOCK)
    reset_prefix_cache(durl)
    alone = generate(durl, ids, request_id=f"ref-exp-{kind}")
    reset_prefix_cache(durl)
    p0 = metrics(purl)
    pre = generate(purl, ids, max_tokens=1, remote_decode=True, request_id=f"exp-{kind}")
    wait_for(lambda: held_blocks(purl) == nblocks, 10, f"prefill side to hold {nblocks} blocks")
    # Nobody reads: the lease frees the blocks.
    wait_for(lambda: held_blocks(purl) == 0, LEASE_S + 10, "lease expiry")
    assert metric(metrics(purl), "pdserve_kv_lease_expiries_total") == metric(p0, "pdserve_kv_lease_expiries_total") + 1
    wait_for(lambda: kv_usage(purl) == 0.0, 10, "prefill KV usage back to baseline")
    d0 = metrics(durl)
    late = generate(durl, ids, kv_transfer=pre.kv_transfer, request_id=f"late-{kind}")
    d1 = metrics(durl)
    assert late.tokens == alone.tokens  # correct output, recomputed, never stale memory
    assert metric(d1, "pdserve_kv_recomputes_total") == metric(d0, "pdserve_kv_recomputes_total") + 1
    assert metric(d1, "pdserve_kv_bytes_transferred_total") == metric(d0, "pdserve_kv_bytes_transferred_total")


def test_blocks_return_to_baseline_after_aborts(pair, tokenizer):
    kind, purl, durl, _ = pair
    ps = prompts(tokenizer)
    p_exp0 = metric(metrics(purl), "pdserve_kv_lease_expiries_total")
    # 1. Abort during prefill: the request never finishes, nothing is held.
    with httpx.stream("POST", f"{purl}/generate", timeout=30, json={
            "request_id": f"abort-pre-{kind}", "prompt_token_ids": ps[11], "remote_decode": True,
            "sampling": {"max_tokens": 1, "temperature": 0.0}}) as r:
        assert r.status_code == 200
    # 2. Prefill done, decode aborted right after it started (before or during its read).
    pre = generate(purl, ps[10], max_tokens=1, remote_decode=True, request_id=f"abort-dec-p-{kind}")
    with httpx.stream("POST", f"{durl}/generate", timeout=30, json={
            "request_id": f"abort-dec-{kind}", "prompt_token_ids": ps[10], "kv_transfer": pre.kv_transfer,
            "sampling": {"max_tokens": 400, "temperature": 0.0}}) as r:
        assert r.status_code == 200
    # 3. Decode aborted after its transfer, mid-generation.
    pre = generate(purl, ps[9], max_tokens=1, remote_decode=True, request_id=f"abort-gen-p-{kind}")
    with httpx.stream("POST", f"{durl}/generate", timeout=30, json={
            "request_id": f"abort-gen-{kind}", "prompt_token_ids": ps[9], "kv_transfer": pre.kv_transfer,
            "sampling": {"max_tokens": 2000, "temperature": 0.0}}) as r:
        lines = r.iter_lines()
        assert next(lines)
    for url in (purl, durl):
        wait_for(lambda: httpx.get(f"{url}/load").json()["active_requests"] == 0, 20, "workers idle")
    # Every hold is released by its reader or by lease; usage returns to zero on both sides.
    wait_for(lambda: held_blocks(purl) == 0, LEASE_S + 15, "prefill holds released")
    wait_for(lambda: kv_usage(purl) == 0.0 and kv_usage(durl) == 0.0, 20, "KV usage back to baseline")
    # Released by readers, not left to expire (at most the aborted-before-read case may expire).
    assert metric(metrics(purl), "pdserve_kv_lease_expiries_total") - p_exp0 <= 1


def test_mismatched_kv_dtype_is_refused_with_both_values(pair, model_dir, tokenizer, request):
    """A decode engine whose KV cache dtype differs from the prefill's: bf16 against an fp8
    pair, the session's real cluster's decode worker (bf16, started anyway; no third engine
    to start here); where fp8 is not available, an engine of the other 16/32-bit dtype."""
    kind, purl, _, _ = pair
    proc = None
    if kind == "fp8":
        cluster = request.getfixturevalue("real_disagg")
        log, durl, local, remote = cluster.procs["decode1"].log_path, cluster.urls["decode1"], "bfloat16", "fp8"
    else:
        pair_dtype = "float32" if kind == "fp32" else "bfloat16"
        local = "bfloat16" if kind == "fp32" else "float32"
        proc, durl = start_worker("decode", 1, model_dir, ["--dtype", local])
        log, remote = proc.log_path, pair_dtype
    try:
        ids = prompts(tokenizer)[8]
        pre = generate(purl, ids, max_tokens=1, remote_decode=True, request_id="mismatch-p")
        d0 = metrics(durl)
        out = generate(durl, ids, kv_transfer=pre.kv_transfer, request_id="mismatch-d")
        assert out.error is None and len(out.tokens) > 0  # served by local recompute
        d1 = metrics(durl)
        assert metric(d1, "pdserve_kv_transfer_failures_total") == metric(d0, "pdserve_kv_transfer_failures_total") + 1
        assert metric(d1, "pdserve_kv_bytes_transferred_total") == metric(d0, "pdserve_kv_bytes_transferred_total")
        wait_for(lambda: f"KV cache dtype: local {local!r} vs remote {remote!r}" in log.read_text(), 10,
                 "the mismatch message in the decode worker's log")
        # The prefill side is released at once (not left to the lease).
        wait_for(lambda: held_blocks(purl) == 0, 5, "prefill hold released")
    finally:
        if proc is not None:
            proc.stop()
