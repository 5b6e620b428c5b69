"""A decode engine's loads in flight, as the reader tracks them: being prepared (handshake,
acquire or push on an io thread), a READ posted, a push awaiting its notification, and
the holders it has shaken hands with."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from kvtransfer.protocol import EngineMetadata, LoadSpec
from kvtransfer.side_channel import SideChannelClient


@dataclass
class Read:
    spec: LoadSpec
    handle: Any
    peer: str
    nbytes: int
    started: float
    deadline: float
    finished_at: float | None = None  # when an inline progress loop saw it complete


@dataclass
class Pushed:
    """A push the holder accepted: waiting for its notification."""

    spec: LoadSpec
    nbytes: int
    started: float  # when the (accepted) Push was sent: the WRITE's time includes the round trip
    deadline: float


@dataclass
class Peer:
    """A holder engine this reader has shaken hands with. `agent_name` is set by the engine
    thread once the NIXL agent is added (NIXL calls stay on that thread)."""

    metadata: EngineMetadata
    client: SideChannelClient
    mode: str = "pull"  # how this pair moves blocks (pair_mode)
    lock: threading.Lock = field(default_factory=threading.Lock)  # REQ sockets are not thread-safe
    agent_name: str | None = None


@dataclass
class Preparing:
    spec: LoadSpec
    future: Future
    created: float = 0.0  # before the acquire was sent: the read's deadline counts from here
