"""`pdserve bench kv` (micro): raw NIXL READ and WRITE between two processes, against a
single-process memcpy of the same bytes and, with `--impls ucxx`, raw UCX through UCXX in its
own environment, in the same run.

For each UCX transport profile that works here and each block size (16 KiB .. 2 MiB), the
initiator moves `--total-mib` of randomly placed blocks from/to a target process in one
transfer per batch (the target keeps calling into NIXL: the progress thread is off, as in
the connector), `--repeats` times (default 5). memcpy copies the same random blocks inside
one process. Results go to `bench_kv.json`: per case `read_gbps`, `write_gbps`,
`memcpy_gbps` (medians over the repeats), `ratio_to_memcpy` (READ / memcpy), and each one's
`*_spread` (min / median / max / n); with ucxx, `ucxx` rows (tagged sends, `ucxx_raw.py`).
Only NIXL and numpy are needed (no vLLM, no torch).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import statistics
import time
from pathlib import Path

import numpy as np

from bench.perf.errors import PerfError

BLOCK_SIZES = [16 << 10, 64 << 10, 256 << 10, 1 << 20, 2 << 20]
TRANSPORTS = ["shm", "tcp"]
BATCH_BYTES = 32 << 20  # bytes per transfer request (descriptors batched like the connector's)


def _agent(name: str, transport: str):
    from kvtransfer import transport as tp

    tp.apply(transport)
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=[]))
    agent.create_backend("UCX", {"ucx_error_handling_mode": "none" if transport == "shm" else "peer"})
    return agent


def _target(conn, transport: str, nbytes: int) -> None:
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    agent = _agent("bench-target", transport)
    buf = np.random.default_rng(1).integers(0, 255, nbytes, dtype=np.uint8)
    agent.register_memory([(buf.ctypes.data, nbytes, 0, "")], "DRAM")
    conn.send((agent.get_agent_metadata(), buf.ctypes.data))
    remote_md = conn.recv()
    agent.add_remote_agent(remote_md)
    while not conn.poll(0):
        agent.get_new_notifs()  # keep UCX progressing for the initiator
    conn.recv()
    conn.close()


def _descs(rng, nblocks: int, block: int, base: int, capacity: int) -> np.ndarray:
    slots = rng.choice(capacity // block, size=nblocks, replace=False)
    out = np.empty((nblocks, 3), dtype=np.uint64)
    out[:, 0] = base + slots.astype(np.uint64) * block
    out[:, 1] = block
    out[:, 2] = 0
    return out


def _run(agent, op: str, local: np.ndarray, remote: np.ndarray, peer: str, block: int) -> float:
    t0 = time.perf_counter()
    moved = 0
    per = max(1, BATCH_BYTES // block)
    for i in range(0, len(local), per):
        ld = agent.get_xfer_descs(local[i:i + per], "DRAM")
        rd = agent.get_xfer_descs(remote[i:i + per], "DRAM")
        h = agent.initialize_xfer(op, ld, rd, peer, b"")
        state = agent.transfer(h)
        while state == "PROC":
            state = agent.check_xfer_state(h)
        if state != "DONE":
            raise PerfError(f"{op} failed ({state})")
        agent.release_xfer_handle(h)
        moved += int(local[i:i + per, 1].sum())
    return moved / (time.perf_counter() - t0) / 1e9


def memcpy_gbps(total: int, block: int, rng) -> float:
    """The same random blocks copied inside one process (ctypes.memmove per block; both
    buffers pre-faulted so page faults are not counted)."""
    import ctypes

    src = np.random.default_rng(2).integers(0, 255, 2 * total, dtype=np.uint8)
    dst = np.ones(2 * total, dtype=np.uint8)
    n = total // block
    sb, db = src.ctypes.data, dst.ctypes.data
    s = (rng.choice(2 * total // block, size=n, replace=False) * block + sb).tolist()
    d = (rng.choice(2 * total // block, size=n, replace=False) * block + db).tolist()
    move = ctypes.memmove
    for a, b in zip(s[: n // 8], d[: n // 8]):  # warm-up
        move(b, a, block)
    t0 = time.perf_counter()
    for a, b in zip(s, d):
        move(b, a, block)
    return total / (time.perf_counter() - t0) / 1e9


def spread(values: list[float]) -> dict:
    return {"min": min(values), "median": statistics.median(values), "max": max(values), "n": len(values)}


def case(transport: str, total: int, block_sizes: list[int] | None = None, repeats: int = 1) -> list[dict]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    capacity = 2 * total
    proc = ctx.Process(target=_target, args=(child, transport, capacity), daemon=True)
    proc.start()
    rows = []
    try:
        os.environ.setdefault("UCX_NET_DEVICES", "lo")
        agent = _agent("bench-initiator", transport)
        # Touched before use, as the target's random buffer is and as an engine's KV cache is:
        # an untouched (calloc'd) destination made READ pay a page fault per 4 KiB page
        # inside the transfer (measured: READ 0.23-4.1 GB/s against WRITE 7.4-8.2, and 7.7-8.0
        # vs 7.7 once touched), which this benchmark once reported as READ being slow.
        local = np.ones(capacity, dtype=np.uint8)
        agent.register_memory([(local.ctypes.data, capacity, 0, "")], "DRAM")
        if not parent.poll(60):
            raise PerfError("the target process did not start")
        remote_md, remote_base = parent.recv()
        peer = agent.add_remote_agent(remote_md)
        peer = peer.decode() if isinstance(peer, bytes) else peer
        parent.send(agent.get_agent_metadata())
        rng = np.random.default_rng(0)
        for block in block_sizes or BLOCK_SIZES:
            n = total // block
            ld = _descs(rng, n, block, local.ctypes.data, capacity)
            rd = _descs(rng, n, block, remote_base, capacity)
            _run(agent, "READ", ld[: max(1, n // 8)], rd[: max(1, n // 8)], peer, block)  # warm-up
            reads, writes, mems = [], [], []
            for _ in range(repeats):  # interleaved, so drift on a shared machine hits all three alike
                reads.append(_run(agent, "READ", ld, rd, peer, block))
                writes.append(_run(agent, "WRITE", ld, rd, peer, block))
                mems.append(memcpy_gbps(total, block, rng))
            rs, ws, ms = spread(reads), spread(writes), spread(mems)
            read, write, mem = rs["median"], ws["median"], ms["median"]
            rows.append({"transport": transport, "block_bytes": block, "total_bytes": n * block,
                         "read_gbps": read, "write_gbps": write, "memcpy_gbps": mem,
                         "ratio_to_memcpy": read / mem, "read_gbps_spread": rs, "write_gbps_spread": ws,
                         "memcpy_gbps_spread": ms})
            print(f"{transport:4s} {block >> 10:5d} KiB  READ {read:6.2f} [{rs['min']:.2f}-{rs['max']:.2f}]  "
                  f"WRITE {write:6.2f} [{ws['min']:.2f}-{ws['max']:.2f}]  memcpy {mem:6.2f} GB/s  "
                  f"READ/memcpy {read / mem:4.2f}", flush=True)
    finally:
        stop_target(parent, proc)
    return rows


def stop_target(conn, proc) -> None:
    """Tell a benchmark's target process to stop; kill it if it has not in 30 s."""
    try:
        conn.send("stop")
    except OSError:  # it is gone already
        pass
    proc.join(timeout=30)
    if proc.is_alive():
        proc.kill()


def ucxx_python() -> Path:
    """The UCXX environment's interpreter (`make ucxx`; env PDSERVE_UCXX_PYTHON overrides)."""
    env = os.environ.get("PDSERVE_UCXX_PYTHON")
    if env:
        return Path(env)
    for root in (Path.cwd(), Path(__file__).resolve().parents[3]):
        if (root / ".venv-ucxx" / "bin" / "python").is_file():
            return root / ".venv-ucxx" / "bin" / "python"
    return Path(".venv-ucxx/bin/python")


def require_ucxx() -> Path:
    """The UCXX interpreter, or PerfError (one line) when `make ucxx` has not been run."""
    python = ucxx_python()
    if not python.is_file():
        raise PerfError(f"--impls ucxx: no UCXX environment at {python}; run `make ucxx` (or set PDSERVE_UCXX_PYTHON)")
    return python


def ucxx_rows(total_mib: int, repeats: int, block_sizes: list[int]) -> list[dict]:
    """Raw UCX tagged sends through UCXX, in its own process and environment."""
    import subprocess

    python = require_ucxx()
    script = Path(__file__).with_name("ucxx_raw.py")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    env.update(UCX_NET_DEVICES="lo", UCX_WARN_UNUSED_ENV_VARS="n")
    r = subprocess.run([str(python), str(script), "--total-mib", str(total_mib), "--repeats", str(repeats),
                        "--blocks", *map(str, block_sizes)], capture_output=True, text=True, timeout=1200, env=env)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode != 0 or not lines:
        tail = (r.stderr.strip().splitlines() or ["no output"])[-1]
        raise PerfError(f"--impls ucxx: the UCXX benchmark failed (exit {r.returncode}): {tail}")
    out = json.loads(lines[-1])
    rows = []
    for c in out["cases"]:
        s = spread(c["gbps"])
        rows.append({"impl": "ucxx", "block_bytes": c["block_bytes"], "total_bytes": c["total_bytes"],
                     "send_gbps": s["median"], "send_gbps_spread": s, "ucxx": out["ucxx"],
                     "ucx_rndv_thresh": out["ucx_rndv_thresh"]})
        print(f"ucxx {c['block_bytes'] >> 10:5d} KiB  tagged send {s['median']:6.2f} [{s['min']:.2f}-{s['max']:.2f}] "
              f"GB/s (UCX_RNDV_THRESH={out['ucx_rndv_thresh']})", flush=True)
    return rows


def run(out_dir: str, total_mib: int, transports: list[str], repeats: int = 5,
        impls: tuple[str, ...] = ("nixl",)) -> dict:
    if repeats < 1:
        raise PerfError("--repeats must be at least 1")
    results = {"total_mib": total_mib, "batch_bytes": BATCH_BYTES, "repeats": repeats, "cases": []}
    if "ucxx" in impls:
        require_ucxx()  # before any NIXL work: a missing install is one line at once
    for t in transports:
        try:
            results["cases"] += case(t, total_mib << 20, repeats=repeats)
        except Exception as exc:  # a transport that does not work here is reported, not fatal
            print(f"{t}: not available here ({exc})", flush=True)
            results.setdefault("unavailable", {})[t] = str(exc)
    if "ucxx" in impls:
        results["ucxx"] = ucxx_rows(total_mib, repeats, BLOCK_SIZES)
    path = Path(out_dir)
    path.mkdir(parents=True, exist_ok=True)
    (path / "bench_kv.json").write_text(json.dumps(results, indent=2))
    print(f"wrote {path / 'bench_kv.json'}")
    return results
