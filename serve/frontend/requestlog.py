"""The frontend's exact record of finished requests, for an autoscaler's observation: a
bounded ring of `RequestSample`s read with `GET /internal/requests?since=N` (histogram
buckets are too coarse around a latency target; these are the requests themselves).

Each request is recorded once, when it ends (success or failure), with its arrival on the
wall clock so a reader can tell recent arrivals from a backlog drained late.
"""

from __future__ import annotations

import time
from collections import deque

from serve import protocol as p

KEEP = 20_000  # samples kept: minutes of traffic at hundreds of requests/s


class RequestLog:
    def __init__(self, keep: int = KEEP) -> None:
        self.samples: deque[p.RequestSample] = deque(maxlen=keep)
        self.seq = 0  # samples recorded so far
        self.arrivals = 0  # requests admitted so far

    def arrived(self) -> None:
        self.arrivals += 1

    def record(self, received_mono: float, isl: int, osl: int, ttft_s: float | None, ok: bool) -> None:
        now_mono = time.monotonic()
        arrival = time.time() - (now_mono - received_mono)
        self.seq += 1
        self.samples.append(p.RequestSample(seq=self.seq, arrival=round(arrival, 4), isl=isl, osl=osl,
                                            ttft_s=None if ttft_s is None else round(ttft_s, 6),
                                            duration_s=round(now_mono - received_mono, 6), ok=ok))

    def since(self, seq: int, limit: int = KEEP) -> tuple[list[p.RequestSample], int, int]:
        """(samples after `seq`, oldest first, at most `limit`; the next `since`; how many after
        `seq` are no longer kept)."""
        if seq > self.seq:  # a reader from before this frontend restarted: from the start
            seq = 0
        first = self.samples[0].seq if self.samples else self.seq + 1
        dropped = max(0, first - seq - 1)
        out = [s for s in self.samples if s.seq > seq][:limit]
        return out, out[-1].seq if out else max(seq, first - 1), dropped
