"""The test-only fault hook: a pause before each READ, from the config or from a file."""

from kvtransfer import faults


def test_no_pause_by_default(monkeypatch):
    monkeypatch.delenv(faults.FAULT_PAUSE_FILE_ENV, raising=False)
    slept = []
    assert faults.pause_before_read(0.0, slept.append) == 0.0
    assert slept == []


def test_configured_pause_wins(monkeypatch, tmp_path):
    f = tmp_path / "pause"
    f.write_text("9")
    monkeypatch.setenv(faults.FAULT_PAUSE_FILE_ENV, str(f))
    slept = []
    assert faults.pause_before_read(1.5, slept.append) == 1.5
    assert slept == [1.5]


def test_pause_from_the_file_while_it_exists(monkeypatch, tmp_path):
    f = tmp_path / "pause"
    monkeypatch.setenv(faults.FAULT_PAUSE_FILE_ENV, str(f))
    assert faults.pause_from_file() == 0.0  # not there yet
    f.write_text(" 2.5\n")
    slept = []
    assert faults.pause_before_read(0.0, slept.append) == 2.5 and slept == [2.5]
    for junk in ("", "soon", "-3"):
        f.write_text(junk)
        assert faults.pause_from_file() == 0.0
    f.unlink()
    assert faults.pause_from_file() == 0.0
