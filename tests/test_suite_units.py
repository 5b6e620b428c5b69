"""How tests/conftest.py spreads the suite over xdist workers: every module that starts real
engines is in the one serial engine unit; modules that only import the engine stack are not;
the modules that import torch share a unit; the long units it hands out first exist. And the
engine flags tests/helpers/procs.py adds on a CPU without AVX-512 or AMX."""

from __future__ import annotations

from tests.conftest import ENGINE_UNIT, LONG_UNITS, TESTS, TORCH_UNIT, _unit_of


def test_engine_modules_share_the_serial_unit_and_import_only_modules_do_not():
    for module in ("tests/serve/test_faults.py", "tests/kvtransfer/test_transfer_e2e.py",
                   "tests/serve/test_disagg_e2e.py", "tests/k8s/test_cpu_overlay_local.py"):
        assert _unit_of(module) == ENGINE_UNIT, module
    # Engine-marked (they need torch or vLLM) but start no engine: units of their own.
    for module in ("tests/serve/test_model.py", "tests/serve/test_cpu_attention.py"):
        assert _unit_of(module) == module, module
    assert _unit_of("tests/router/test_scoring_router.py") == "tests/router/test_scoring_router.py"


def test_modules_that_import_torch_share_one_unit():
    torch_modules = sorted(str(p.relative_to(TESTS.parent)) for p in TESTS.rglob("test_*.py")
                           if "\nIMPORTS_TORCH = True" in p.read_text())
    assert {"tests/kvtransfer/test_metrics.py", "tests/kvtransfer/test_scheduler.py"} <= set(torch_modules)
    assert {_unit_of(m) for m in torch_modules} == {TORCH_UNIT}


def test_the_long_units_exist():
    assert LONG_UNITS[:2] == (ENGINE_UNIT, TORCH_UNIT)
    for module in LONG_UNITS[2:]:
        assert (TESTS.parent / module).is_file(), module


def test_engine_flags_ask_for_float32_only_on_a_cpu_without_avx512_or_amx():
    """tests/helpers/procs.py reads /proc/cpuinfo's flags: the compared test engines run float32
    where vLLM's bf16 kernels are slow (AVX2 only), the model's dtype elsewhere."""
    from tests.helpers.procs import ENGINE_FLAGS, fast_16bit_cpu

    avx2 = "processor\t: 0\nflags\t\t: fpu sse sse2 avx avx2 fma\n"
    assert fast_16bit_cpu(avx2) is False
    assert fast_16bit_cpu(avx2.replace("avx2", "avx2 avx512f avx512bw")) is True
    assert fast_16bit_cpu(avx2.replace("avx2", "avx2 amx_tile amx_bf16")) is True
    assert fast_16bit_cpu("processor\t: 0\n") is True  # no flags line (not x86): nothing changed
    assert ENGINE_FLAGS == ([] if fast_16bit_cpu() else ["--dtype", "float32"])
