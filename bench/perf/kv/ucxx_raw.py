"""Raw UCX through UCXX (`pdserve bench kv --impls ucxx`): two processes, one tagged send per
block from a client to a server over loopback (WINDOW in flight at once), timed on the client until the server has
acknowledged every byte. A reference for what UCX itself moves here, beside NIXL's READ and
WRITE.

Runs in its own environment (`make ucxx` makes `.venv-ucxx`; the benchmark starts this file
with that interpreter): it imports only numpy, ucxx and the standard library, never pdserve,
and `import ucxx` sets UCX_RNDV_THRESH (8192 in ucxx 0.52) in its process, which must not
reach a NIXL agent. Prints one JSON object: per block size the GB/s of each repeat.

    .venv-ucxx/bin/python bench/perf/kv/ucxx_raw.py --total-mib 256 --repeats 5 --blocks 65536 1048576
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import sys
import time

ACK = 1
WINDOW = 32  # sends (and receives) in flight at once, as NIXL posts a transfer's descriptors together


def _windows(n: int) -> list[int]:
    return [min(WINDOW, n - i) for i in range(0, n, WINDOW)]


def _server(port_q, blocks: list[int], total: int, repeats: int) -> None:
    import numpy as np
    import ucxx

    async def main() -> None:
        done = asyncio.Event()

        async def handler(ep) -> None:
            for block in blocks:
                bufs = [np.empty(block, dtype=np.uint8) for _ in range(WINDOW)]
                for _ in range(repeats + 1):  # a warm-up pass, then the timed ones
                    for k in _windows(max(1, total // block)):
                        await asyncio.gather(*(ep.recv(bufs[j]) for j in range(k)))
                    await ep.send(np.array([ACK], dtype=np.uint8))
            await ep.close()
            done.set()

        listener = ucxx.create_listener(handler)
        port_q.put(listener.port)
        await asyncio.wait_for(done.wait(), timeout=600)
        listener.close()

    asyncio.run(main())


async def _client(port: int, blocks: list[int], total: int, repeats: int) -> dict:
    import numpy as np
    import ucxx

    ep = await ucxx.create_endpoint("127.0.0.1", port)
    ack = np.empty(1, dtype=np.uint8)
    rows = []
    for block in blocks:
        n = max(1, total // block)
        src = np.random.default_rng(0).integers(0, 255, block, dtype=np.uint8)
        gbps = []
        for rep in range(repeats + 1):
            t0 = time.perf_counter()
            for k in _windows(n):
                await asyncio.gather(*(ep.send(src) for _ in range(k)))
            await ep.recv(ack)
            if rep:  # the first pass warms up
                gbps.append(n * block / (time.perf_counter() - t0) / 1e9)
        rows.append({"block_bytes": block, "total_bytes": n * block, "gbps": gbps})
    await ep.close()
    return {"ucxx": ucxx.__version__, "ucx_rndv_thresh": os.environ.get("UCX_RNDV_THRESH"), "cases": rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--total-mib", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--blocks", type=int, nargs="+", required=True)
    args = p.parse_args(argv)
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    total = args.total_mib << 20
    server = ctx.Process(target=_server, args=(q, args.blocks, total, args.repeats), daemon=True)
    server.start()
    try:
        port = q.get(timeout=120)
        out = asyncio.run(asyncio.wait_for(_client(port, args.blocks, total, args.repeats), timeout=600))
    finally:
        server.join(timeout=30)
        if server.is_alive():
            server.kill()
    json.dump(out, sys.stdout)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
