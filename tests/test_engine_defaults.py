"""The vLLM flags pdserve adds on CPU, and that a user's own choice always wins."""

from serve.engine import with_cpu_defaults


def test_cpu_defaults_added_when_unset():
    assert with_cpu_defaults(["--max-num-seqs", "8"]) == [
        "--enforce-eager", "--no-enable-chunked-prefill", "--max-num-seqs", "8"]


def test_user_choices_win():
    assert with_cpu_defaults(["--enable-chunked-prefill"]) == ["--enforce-eager", "--enable-chunked-prefill"]
    assert with_cpu_defaults(["--enable-chunked-prefill=false"]) == ["--enforce-eager",
                                                                     "--enable-chunked-prefill=false"]
    assert with_cpu_defaults(["-O3"]) == ["--no-enable-chunked-prefill", "-O3"]
    assert with_cpu_defaults(["--no-enforce-eager", "--no-enable-chunked-prefill"]) == [
        "--no-enforce-eager", "--no-enable-chunked-prefill"]
