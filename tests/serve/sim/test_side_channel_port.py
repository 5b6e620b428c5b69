"""A simulated prefill worker whose picked side-channel port was taken meanwhile (hundreds
of workers starting at once) picks another; a port the user chose is not changed."""

import socket

import pytest
import zmq

from serve.sim.backend import SimBackend, SimRole
from serve.sim.config import parse_sim_options


def taken_port() -> tuple[socket.socket, int]:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s, s.getsockname()[1]


async def test_a_taken_auto_port_is_replaced_and_a_chosen_one_fails(model_dir):
    sock, port = taken_port()
    try:
        opts = parse_sim_options([], model_dir, 1)
        auto = SimBackend(opts, SimRole(role="prefill", engine_id="p0", model=model_dir, served_model_name="m",
                                        side_channel_port=port, side_channel_auto=True))
        await auto.start()
        try:
            assert auto.role.side_channel_port != port
            assert auto.holder.endpoint.endswith(f":{auto.role.side_channel_port}")
        finally:
            await auto.stop()
        chosen = SimBackend(opts, SimRole(role="prefill", engine_id="p1", model=model_dir, served_model_name="m",
                                          side_channel_port=port))
        with pytest.raises(zmq.ZMQError):
            await chosen.start()
    finally:
        sock.close()
