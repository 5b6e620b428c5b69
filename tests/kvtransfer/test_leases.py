"""The lease table alone, on a fake clock: no threads, no NIXL, no sockets."""

import pytest

from kvtransfer.leases import FINISHED_GRACE_S, READ_PIN_MARGIN_S, LeaseTable

READ_TIMEOUT_S = 5.0


class Clock:
    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def table(clock: Clock) -> LeaseTable:
    return LeaseTable(READ_TIMEOUT_S, clock=clock)


def test_held_blocks_are_not_freed_before_the_lease(table, clock):
    table.hold("r", 4, 10.0)
    s = table.settle({"r"})
    assert s.sending == set() and s.held_blocks == 4
    clock.t += 10.0  # at the expiry itself, still held
    assert table.settle(set()).sending == set()


def test_expiry_frees_unread_blocks_and_counts_it(table, clock):
    table.hold("r", 4, 10.0)
    table.settle({"r"})
    clock.t += 10.5
    s = table.settle(set())
    assert s.sending == {"r"} and s.held_blocks == 0 and s.lease_expiries == 1 and s.blocks_released == 0
    assert table.settle(set()).lease_expiries == 0  # counted once


def test_sweep_expires_between_steps(table, clock):
    table.hold("r", 1, 1.0)
    clock.t += 2
    assert table.sweep() == 1
    assert table.acquire("r").status == "gone"
    assert table.settle({"r"}).sending == {"r"}


def test_acquire_pins_past_the_lease_until_release(table, clock):
    table.hold("r", 3, 2.0)
    assert table.acquire("r").status == "ok"
    assert table.reading()
    clock.t += 2.0 + READ_TIMEOUT_S  # well past the lease, within the pin
    assert table.sweep() == 0
    assert table.settle({"r"}).sending == set()
    assert table.release("r") is True
    assert not table.reading()
    s = table.settle(set())
    assert s.sending == {"r"} and s.blocks_released == 3 and s.lease_expiries == 0


def test_pin_outlasts_the_read_timeout_then_expires(table, clock):
    """A reader that died mid-read cannot strand blocks: the pin ends too."""
    table.hold("r", 3, 2.0)
    table.acquire("r")
    clock.t += READ_TIMEOUT_S + READ_PIN_MARGIN_S - 0.01
    assert table.sweep() == 0
    clock.t += 0.02
    assert table.sweep() == 1
    assert table.settle({"r"}).sending == {"r"}


def test_acquire_after_the_lease_is_gone_even_before_a_sweep(table, clock):
    table.hold("r", 2, 1.0)
    clock.t += 1.5
    reply = table.acquire("r")
    assert (reply.status, reply.message) == ("gone", "lease expired")
    assert table.settle({"r"}).lease_expiries == 1


def test_release_frees_at_once(table):
    table.hold("r", 7, 30.0)
    table.settle({"r"})
    assert table.release("r") is True
    s = table.settle(set())
    assert s.sending == {"r"} and s.blocks_released == 7
    assert table.release("r") is False  # a second release frees nothing


def test_unknown_id_is_pending_and_freed_id_is_gone(table):
    assert table.acquire("later").status == "pending"  # its hold may still come
    table.hold("r", 1, 30.0)
    table.release("r")
    assert table.acquire("r").status == "gone"  # freed, not yet reported
    table.settle({"r"})
    reply = table.acquire("r")  # reported and forgotten: still remembered as freed
    assert (reply.status, reply.message) == ("gone", "blocks already freed (lease expired or released)")


def test_freed_memory_is_bounded(clock):
    table = LeaseTable(READ_TIMEOUT_S, clock=clock, freed_memory=2)
    for rid in ("a", "b", "c"):
        table.hold(rid, 1, 30.0)
        table.release(rid)
        table.settle({rid})
    assert table.acquire("a").status == "pending"  # forgotten, oldest first
    assert table.acquire("b").status == "gone" and table.acquire("c").status == "gone"


def test_freed_before_finished_waits_for_vllm(table):
    table.hold("r", 1, 30.0)
    table.release("r")
    assert table.settle(set()).sending == set()  # vLLM has not reported it finished yet
    assert table.settle({"r"}).sending == {"r"}


def test_finished_ids_without_holds_go_after_the_grace(table, clock):
    table.settle({"plain", "held"})
    table.hold("held", 1, 1000.0)
    clock.t += FINISHED_GRACE_S
    table.settle({"new"})
    assert table.finished_ids == {"plain", "held", "new"}  # at the grace itself, still kept
    clock.t += 1
    table.settle(set())
    assert table.finished_ids == {"held", "new"}  # the held one stays until freed
    table.release("held")
    assert table.settle(set()).sending == {"held"}
    assert table.finished_ids == {"new"}


def test_finished_id_whose_hold_comes_late_is_still_sent(table, clock):
    table.settle({"r"})  # vLLM reports it finished before the hold reaches the worker
    clock.t += FINISHED_GRACE_S / 2
    table.hold("r", 2, 5.0)
    table.release("r")
    assert table.settle(set()).sending == {"r"}
