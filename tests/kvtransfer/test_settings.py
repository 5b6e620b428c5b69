"""ConnectorSettings: the typed kv_connector_extra_config, its one pair of conversions, and
the connector's side-channel endpoints from it."""

import json

import pytest

from kvtransfer.errors import KVTransferError, SettingsError
from kvtransfer.protocol import ConnectorSettings


def test_defaults_are_the_connectors():
    s = ConnectorSettings()
    assert (s.engine_id, s.side_channel_host, s.side_channel_port, s.side_channel_bind_all) == ("", "", 0, False)
    assert (s.lease_seconds, s.read_timeout_s, s.handshake_timeout_s) == (30.0, 30.0, 5.0)
    assert (s.transport, s.fault_pause_s) == ("auto", 0.0)
    assert ConnectorSettings.from_extra_config({}) == s == ConnectorSettings.from_extra_config(None)


@pytest.mark.parametrize("settings", [
    ConnectorSettings(),
    ConnectorSettings(engine_id="p-1", side_channel_host="10.0.0.2", side_channel_port=5601, lease_seconds=4.0,
                      transport="tcp"),
    ConnectorSettings(side_channel_port=1, side_channel_bind_all=True, read_timeout_s=9.0, handshake_timeout_s=0.5,
                      fault_pause_s=2.5, transport="shm"),
])
def test_round_trip(settings):
    extra = settings.to_extra_config()
    assert json.loads(json.dumps(extra)) == extra  # what vLLM gets is plain JSON
    assert ConnectorSettings.from_extra_config(json.loads(json.dumps(extra))) == settings


def test_tuning_keys_are_written_only_when_set():
    base = ConnectorSettings(engine_id="e", side_channel_host="h", side_channel_port=2, lease_seconds=30.0,
                             transport="shm")
    assert base.to_extra_config() == {"engine_id": "e", "side_channel_host": "h", "side_channel_port": 2,
                                      "lease_seconds": 30.0, "transport": "shm"}
    tuned = ConnectorSettings(side_channel_port=2, fault_pause_s=1.5, side_channel_bind_all=True)
    extra = tuned.to_extra_config()
    assert extra["fault_pause_s"] == 1.5 and extra["side_channel_bind_all"] is True
    assert "read_timeout_s" not in extra and "handshake_timeout_s" not in extra


def test_unknown_key_is_an_error_naming_it():
    with pytest.raises(SettingsError, match=r"kv_connector_extra_config\.lease_secs: unknown key") as e:
        ConnectorSettings.from_extra_config({"side_channel_port": 5, "lease_secs": 3})
    assert isinstance(e.value, KVTransferError) and isinstance(e.value, ValueError)
    assert "lease_seconds" in str(e.value)  # the known keys are listed


@pytest.mark.parametrize("key,value", [("side_channel_port", "five"), ("lease_seconds", [1]),
                                       ("engine_id", 12), ("side_channel_bind_all", "maybe")])
def test_wrong_type_is_an_error_naming_the_key(key, value):
    with pytest.raises(SettingsError, match=rf"kv_connector_extra_config\.{key}: Expected"):
        ConnectorSettings.from_extra_config({key: value})


def test_none_is_unset_and_numbers_may_be_strings():
    s = ConnectorSettings.from_extra_config({"engine_id": None, "side_channel_port": "5555", "lease_seconds": "4"})
    assert (s.engine_id, s.side_channel_port, s.lease_seconds) == ("", 5555, 4.0)


def test_not_a_mapping():
    with pytest.raises(SettingsError, match="must be a mapping"):
        ConnectorSettings.from_extra_config(["side_channel_port"])


def test_worker_kv_transfer_config_is_unchanged():
    """serve.engine.kv_transfer_config builds its extra config from ConnectorSettings; the
    JSON is what it was before (same keys, same values, fault_pause_s only when set)."""
    from serve.engine import kv_transfer_config

    cfg = json.loads(kv_transfer_config("prefill", "e1", "127.0.0.1", 5555, 30.0, "shm"))
    assert cfg == {"kv_connector": "PdConnector", "kv_connector_module_path": "kvtransfer.connector",
                   "kv_role": "kv_both", "engine_id": "e1", "kv_load_failure_policy": "recompute",
                   "kv_connector_extra_config": {"engine_id": "e1", "side_channel_host": "127.0.0.1",
                                                 "side_channel_port": 5555, "lease_seconds": 30.0,
                                                 "transport": "shm"}}
    extra = json.loads(kv_transfer_config("decode", "e2", "10.0.0.1", 6000, 4.0, "tcp", 1.5))["kv_connector_extra_config"]
    assert extra == {"engine_id": "e2", "side_channel_host": "10.0.0.1", "side_channel_port": 6000,
                     "lease_seconds": 4.0, "transport": "tcp", "fault_pause_s": 1.5}
    assert ConnectorSettings.from_extra_config(extra).fault_pause_s == 1.5


def test_side_channel_endpoints(monkeypatch):
    def _side_channel(settings: ConnectorSettings) -> tuple[str, str]:
        return settings.side_channel_endpoints()

    monkeypatch.setenv("VLLM_HOST_IP", "10.1.1.1")
    assert _side_channel(ConnectorSettings(side_channel_port=7)) == ("tcp://10.1.1.1:7", "tcp://10.1.1.1:7")
    assert _side_channel(ConnectorSettings(side_channel_host="h", side_channel_port=7, side_channel_bind_all=True)) \
        == ("tcp://0.0.0.0:7", "tcp://h:7")
    monkeypatch.delenv("VLLM_HOST_IP")
    assert _side_channel(ConnectorSettings(side_channel_port=7))[1] == "tcp://127.0.0.1:7"
    with pytest.raises(ValueError, match="side_channel_port is required"):
        _side_channel(ConnectorSettings())
