"""The CPU attention kernel pdserve asks vLLM for (serve.cpu_attention): "vec", not "amx",
whose answers on the embedded model were nonsense on an AMX machine. The real-engine tests
that expect "Paris" (test_frontend_e2e, test_disagg_e2e, test_faults) are what fails when
the wrong kernel runs; these check the switch itself."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from importlib.metadata import entry_points

import pytest

from serve import cpu_attention
from serve.engine import cpu_environment

# vLLM imported in a fresh process, no engine: a unit of its own (tests/conftest.py).
STARTS_NO_ENGINE = True


def test_plugin_is_registered_with_vllm():
    eps = entry_points(group="vllm.general_plugins")
    assert eps["pdserve_cpu_attention"].load() is cpu_attention.register


@pytest.mark.parametrize("raw, want", [("", "auto"), ("auto", "auto"), ("AMX", "auto"), ("vec", "vec"),
                                       (" Vec ", "vec"), ("avx9", "auto")])
def test_wanted_reads_the_environment(monkeypatch, raw, want):
    monkeypatch.setenv(cpu_attention.ENV, raw)
    assert cpu_attention.wanted() == want


@pytest.mark.parametrize("vllm_choice, want, chosen", [
    ("amx", "vec", "vec"), ("amx", "auto", "amx"), ("vec16", "vec", "vec16"), ("neon", "vec", "neon"),
    ("vec", "vec", "vec")])
def test_only_amx_is_replaced(vllm_choice, want, chosen):
    assert cpu_attention.choose(vllm_choice, want) == chosen


def test_workers_ask_for_vec_unless_the_environment_says_otherwise(monkeypatch):
    monkeypatch.delenv(cpu_attention.ENV, raising=False)
    assert cpu_environment("127.0.0.1", "0", 1)[cpu_attention.ENV] == "vec"
    monkeypatch.setenv(cpu_attention.ENV, "auto")
    assert cpu_environment("127.0.0.1", "0", 1)[cpu_attention.ENV] == "auto"


@pytest.mark.engine
def test_vllm_uses_the_kernel_asked_for():
    # In a fresh process, as vLLM's engine core would: "auto" leaves vLLM's chooser alone,
    # "vec" makes the plugin wrap it (once, however often it is loaded).
    code = textwrap.dedent(f"""
        import os
        import torch
        from serve import cpu_attention
        from vllm.v1.attention.backends import cpu_attn
        picks = [cpu_attn._get_attn_isa(torch.bfloat16, 128, 64)]
        os.environ["{cpu_attention.ENV}"] = "auto"
        cpu_attention.register()
        picks.append(cpu_attn._get_attn_isa(torch.bfloat16, 128, 64))
        os.environ["{cpu_attention.ENV}"] = "vec"
        cpu_attention.register()
        cpu_attention.register()
        picks.append(cpu_attn._get_attn_isa(torch.bfloat16, 128, 64))
        print(*picks, torch.cpu._is_amx_tile_supported(), getattr(cpu_attn._get_attn_isa, "pdserve_wrapped", False))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    vllm_pick, auto, vec, amx, wrapped = out.stdout.split()[-5:]
    assert vllm_pick == ("amx" if amx == "True" else "vec")
    assert (auto, vec, wrapped) == (vllm_pick, "vec", "True")
