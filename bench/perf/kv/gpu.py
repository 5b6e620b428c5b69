"""`pdserve bench kv --gpu`: NIXL between GPU memory and host memory, no vLLM.

Two processes on one machine, each with a NIXL agent (UCX backend, progress thread off, the
target keeps calling into NIXL as the connector's holder does). Each case names where the
initiator's and the target's buffers live:

    vram-vram   both on the GPU (UCX cuda_ipc): VRAM-to-VRAM, both directions
    vram-dram   initiator on the GPU, target in pinned host memory: READ moves DRAM-to-VRAM
                (a decode GPU pulling offloaded KV), WRITE moves VRAM-to-DRAM
    dram-vram   initiator in pinned host memory, target on the GPU: WRITE moves DRAM-to-VRAM
                (a host holder pushing into a decode GPU), READ moves VRAM-to-DRAM
    dram-dram   both in host memory (runs without a GPU; the path the CPU suite checks)

For each block size the initiator moves `total` bytes of randomly placed blocks, READ then
WRITE, `repeats` times; each figure is reported as min / median / max GB/s over the repeats.
The in-process reference is torch's copy of the same random blocks (a gather on the GPU for
VRAM-to-VRAM, one contiguous pinned copy for host-to-GPU). Writes `bench_kv_gpu.json`.
Needs NIXL, numpy and torch (CUDA for the vram cases); a case that cannot run here is
reported with its error, not fatal.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time
from pathlib import Path

import numpy as np

from bench.perf.errors import PerfError
from bench.perf.kv.micro import spread, stop_target

BLOCK_SIZES = [16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20]
CASES = ("vram-vram", "vram-dram", "dram-vram", "dram-dram")
BATCH_BYTES = 256 << 20  # bytes per transfer request
XFER_TIMEOUT_S = 60.0  # one transfer request; a stuck UCX path fails its case, not the run


def parse_case(case: str) -> tuple[str, str]:
    """'vram-dram' -> ('VRAM', 'DRAM'): the initiator's and the target's NIXL memory types."""
    parts = case.split("-")
    if case not in CASES or len(parts) != 2:
        raise PerfError(f"unknown GPU KV case {case!r}; choose from {', '.join(CASES)}")
    return parts[0].upper(), parts[1].upper()


def descs(rng, nblocks: int, block: int, base: int, capacity: int, dev: int) -> np.ndarray:
    """`nblocks` distinct random block-aligned slots of a `capacity`-byte buffer at `base`:
    NIXL's Nx3 uint64 [addr, len, device] descriptor array."""
    if nblocks * block > capacity:
        raise PerfError(f"{nblocks} blocks of {block} bytes do not fit in {capacity}")
    slots = rng.choice(capacity // block, size=nblocks, replace=False)
    out = np.empty((nblocks, 3), dtype=np.uint64)
    out[:, 0] = base + slots.astype(np.uint64) * block
    out[:, 1] = block
    out[:, 2] = dev
    return out


def _buffer(mem: str, nbytes: int):
    """A registered-to-be buffer: (tensor, address, device id)."""
    import torch

    if mem == "VRAM":
        t = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        return t, t.data_ptr(), t.device.index or 0
    pin = torch.cuda.is_available()
    t = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    if pin:
        t = t.pin_memory()
    return t, t.data_ptr(), 0


def _agent(name: str):
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=[]))
    agent.create_backend("UCX", {"ucx_error_handling_mode": "none"})
    return agent


def _target(conn, mem: str, nbytes: int) -> None:
    try:
        agent = _agent("bench-gpu-target")
        buf, addr, dev = _buffer(mem, nbytes)
        agent.register_memory([(addr, nbytes, dev, "")], mem)
        conn.send(("ok", agent.get_agent_metadata(), addr, dev))
    except Exception as exc:  # reported by the initiator as the case's error
        conn.send(("error", f"{type(exc).__name__}: {exc}", 0, 0))
        return
    agent.add_remote_agent(conn.recv())
    while not conn.poll(0):
        agent.get_new_notifs()  # keep UCX progressing for the initiator
    conn.recv()
    conn.close()
    del buf


def _move(agent, op: str, local: np.ndarray, remote: np.ndarray, lmem: str, rmem: str, peer: str) -> float:
    """GB/s of one pass: all of `local` <-> `remote`, BATCH_BYTES per request."""
    per = max(1, BATCH_BYTES // int(local[0, 1]))
    moved = 0
    t0 = time.perf_counter()
    for i in range(0, len(local), per):
        h = agent.initialize_xfer(op, agent.get_xfer_descs(local[i:i + per], lmem),
                                  agent.get_xfer_descs(remote[i:i + per], rmem), peer, b"")
        state = agent.transfer(h)
        deadline = time.monotonic() + XFER_TIMEOUT_S
        while state == "PROC":
            if time.monotonic() > deadline:
                raise PerfError(f"{op} did not finish in {XFER_TIMEOUT_S:.0f} s")
            state = agent.check_xfer_state(h)
        if state != "DONE":
            raise PerfError(f"{op} failed ({state})")
        agent.release_xfer_handle(h)
        moved += int(local[i:i + per, 1].sum())
    return moved / (time.perf_counter() - t0) / 1e9


def reference_gbps(lmem: str, rmem: str, total: int, block: int, rng) -> float | None:
    """In-process torch copy of the same amount: a random-block gather GPU-to-GPU, one
    contiguous pinned copy host-to-GPU; None for host-to-host (see the DRAM micro bench)."""
    import torch

    if "VRAM" not in (lmem, rmem) or not torch.cuda.is_available():
        return None
    n = total // block
    if lmem == rmem == "VRAM":
        src = torch.randint(0, 255, (2 * n, block), dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        si = torch.as_tensor(rng.choice(2 * n, n, replace=False), device="cuda")
        di = torch.as_tensor(rng.choice(2 * n, n, replace=False), device="cuda")
        copy = lambda: dst.index_copy_(0, di, src.index_select(0, si))  # noqa: E731
    else:
        src = torch.randint(0, 255, (total,), dtype=torch.uint8).pin_memory()
        dst = torch.empty(total, dtype=torch.uint8, device="cuda")
        copy = lambda: dst.copy_(src, non_blocking=True)  # noqa: E731
    copy()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    copy()
    torch.cuda.synchronize()
    return total / (time.perf_counter() - t0) / 1e9


def case(name: str, total: int, repeats: int, block_sizes: list[int] | None = None) -> list[dict]:
    lmem, rmem = parse_case(name)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    capacity = 2 * total
    proc = ctx.Process(target=_target, args=(child, rmem, capacity), daemon=True)
    proc.start()
    rows = []
    try:
        agent = _agent("bench-gpu-initiator")
        buf, laddr, ldev = _buffer(lmem, capacity)
        agent.register_memory([(laddr, capacity, ldev, "")], lmem)
        if not parent.poll(120):
            raise PerfError("the target process did not start")
        status, remote_md, raddr, rdev = parent.recv()
        if status != "ok":
            raise PerfError(f"target: {remote_md}")
        peer = agent.add_remote_agent(remote_md)
        peer = peer.decode() if isinstance(peer, bytes) else peer
        parent.send(agent.get_agent_metadata())
        rng = np.random.default_rng(0)
        for block in block_sizes or BLOCK_SIZES:
            n = total // block
            ld = descs(rng, n, block, laddr, capacity, ldev)
            rd = descs(rng, n, block, raddr, capacity, rdev)
            _move(agent, "READ", ld[: max(1, n // 8)], rd[: max(1, n // 8)], lmem, rmem, peer)  # warm-up
            reads = [_move(agent, "READ", ld, rd, lmem, rmem, peer) for _ in range(repeats)]
            writes = [_move(agent, "WRITE", ld, rd, lmem, rmem, peer) for _ in range(repeats)]
            ref = reference_gbps(lmem, rmem, n * block, block, rng)
            row = {"case": name, "initiator": lmem, "target": rmem, "block_bytes": block,
                   "total_bytes": n * block, "read_gbps": spread(reads), "write_gbps": spread(writes),
                   "torch_copy_gbps": ref}
            rows.append(row)
            r, w = row["read_gbps"], row["write_gbps"]
            print(f"{name:9s} {block >> 10:5d} KiB  READ {r['median']:7.2f} [{r['min']:.2f}-{r['max']:.2f}]  "
                  f"WRITE {w['median']:7.2f} [{w['min']:.2f}-{w['max']:.2f}] GB/s"
                  + (f"  torch copy {ref:7.2f}" if ref else ""), flush=True)
        del buf
    finally:
        stop_target(parent, proc)
    return rows


def environment() -> dict:
    """What the run saw: GPU, CUDA, torch, NIXL, UCX variables."""
    info: dict = {"ucx_env": {k: v for k, v in os.environ.items() if k.startswith("UCX_")}}
    try:
        import torch

        info["torch"] = torch.__version__
        info["cuda"] = torch.version.cuda
        info["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:
        info["torch"] = None
    try:
        from importlib.metadata import version

        info["nixl"] = version("nixl")
    except Exception:
        info["nixl"] = None
    return info


def run(out_dir: str, total_mib: int, cases: list[str], repeats: int = 5,
        block_sizes: list[int] | None = None) -> dict:
    """Every case in `cases`; writes `bench_kv_gpu.json` under `out_dir`."""
    for c in cases:
        parse_case(c)
    if repeats < 1:
        raise PerfError("--repeats must be at least 1")
    results = {"total_mib": total_mib, "repeats": repeats, "batch_bytes": BATCH_BYTES,
               "environment": environment(), "cases": [], "unavailable": {}}
    print(json.dumps(results["environment"]), flush=True)
    for c in cases:
        try:
            results["cases"] += case(c, total_mib << 20, repeats, block_sizes)
        except Exception as exc:  # a path that does not work here is reported, not fatal
            print(f"{c}: not available here ({type(exc).__name__}: {exc})", flush=True)
            results["unavailable"][c] = f"{type(exc).__name__}: {exc}"
    path = Path(out_dir)
    path.mkdir(parents=True, exist_ok=True)
    (path / "bench_kv_gpu.json").write_text(json.dumps(results, indent=2))
    print(f"wrote {path / 'bench_kv_gpu.json'}", flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m bench.perf.kv.gpu", description=__doc__.split("\n")[0])
    p.add_argument("--out", default="artifacts/bench_kv")
    p.add_argument("--total-mib", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--cases", nargs="+", default=["vram-vram", "vram-dram", "dram-vram"], choices=CASES)
    args = p.parse_args(argv)
    res = run(args.out, args.total_mib, args.cases, args.repeats)
    return 0 if res["cases"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
