"""The performance model on small hand-checkable cases."""

from __future__ import annotations

import pytest

from bench.plan.errors import PlanError
import dataclasses
import json

from bench.plan.perf import Engine, predict_disagg, prefill_capacity
from bench.plan.specs import ModelShape, SystemSpec, load_model, load_system

TINY = ModelShape("tiny", hidden=8, layers=2, heads=2, kv_heads=1, head_dim=4, intermediate=16, vocab=10)
ONES = {k: 1.0 for k in ("gemm", "prefill_attention", "hbm", "decode_attention", "nvlink", "network")}
SYS = SystemSpec("unit", peak_tflops={"bf16": 1.0, "fp8": 2.0}, hbm_gbps=1000.0, memory_gib=1.0, nvlink_gbps=100.0,
                 network_gbps={"rdma": 10.0, "tcp": 1.0}, efficiency=ONES, step_overhead_ms=0.0)


def test_parameter_counts():
    # per layer: q 8*2*4=64, k+v 2*8*1*4=64, o 2*4*8=64, mlp 3*8*16=384 -> 576
    assert TINY.params_per_layer == 576
    assert TINY.linear_params == 2 * 576 + 10 * 8
    assert TINY.weight_params == 2 * 576 + 2 * 80  # untied: embedding and LM head


def test_kv_bytes_per_token_fp8_and_bf16():
    assert Engine(TINY, SYS, 1, kv_dtype="fp8").kv_bytes_per_token == 2 * 2 * 1 * 4 * 1
    assert Engine(TINY, SYS, 1, kv_dtype="bf16").kv_bytes_per_token == 2 * 2 * 1 * 4 * 2
    nano = load_model("Llama-3.1-Nemotron-Nano-4B-v1.1")
    assert Engine(nano, SYS, 1, kv_dtype="fp8").kv_bytes_per_token == 2 * 32 * 8 * 128  # 64 KiB


def test_linear_is_the_slower_of_flops_and_weight_streaming():
    e = Engine(TINY, SYS, 1)
    flops = 2 * TINY.linear_params * 1000
    assert e.linear_s(1000) == pytest.approx(flops / 1e12)  # compute-bound
    assert e.linear_s(1) == pytest.approx(TINY.weight_params * 2 / 1e12)  # memory-bound (1000 GB/s)
    assert Engine(TINY, SYS, 2).linear_s(1000) == pytest.approx(flops / 2 / 1e12)


def test_causal_prefill_attention_flops():
    e = Engine(TINY, SYS, 1)
    # 4 * L * H * d * S(S+1)/2 = 4*2*2*4 * 10*11/2 = 3520 FLOPs at 1 TFLOP/s
    assert e.prefill_attention_s(10) == pytest.approx(3520 / 1e12)


def test_kv_transfer_time():
    e = Engine(TINY, SYS, 1, kv_dtype="bf16")
    assert e.kv_transfer_s(1000, "rdma") == pytest.approx(1000 * 32 / 10e9)
    assert e.kv_transfer_s(1000, "tcp") == pytest.approx(10 * e.kv_transfer_s(1000, "rdma"))
    assert Engine(TINY, SYS, 1, kv_dtype="fp8").kv_transfer_s(1000, "tcp") == pytest.approx(e.kv_transfer_s(1000, "tcp") / 2)


def test_allreduce_only_with_tp():
    assert Engine(TINY, SYS, 1).allreduce_s(100) == 0
    # 2 all-reduces per layer x 2 layers, each 2*(2-1)/2 * 100*8*2 bytes / 100 GB/s + 10 us
    assert Engine(TINY, SYS, 2).allreduce_s(100) == pytest.approx(4 * (1600 / 100e9 + 10e-6))


def test_prefill_capacity_respects_the_ttft_budget():
    e = Engine(TINY, SYS, 1)
    s = e.prefill_s(10)
    cap, ttft = prefill_capacity(e, 1, 10, 3 * s)
    assert ttft == pytest.approx(3 * s) or ttft < 3 * s
    assert 0 < cap <= 0.95 / s
    assert prefill_capacity(e, 1, 10, s / 2) == (0.0, s)


def test_disagg_factors_scale_the_worker_steps_and_capacities():
    plain = Engine(TINY, SYS, 1)
    factors = {"prefill_latency": 1.1, "decode_latency": 1.08, "prefill_utilisation": 0.9, "decode_occupancy": 0.92}
    e = Engine(TINY, dataclasses.replace(SYS, disagg=factors), 1)
    step = plain.step_s(4, 10 + 8 / 2)
    base = predict_disagg(plain, plain, 1, 1, 1, 4, 10, 8, 1e6, "rdma")
    p = predict_disagg(e, e, 1, 1, 1, 4, 10, 8, 1e6, "rdma")
    assert base.tpot_ms == pytest.approx(step * 1e3)
    assert p.tpot_ms == pytest.approx(1.08 * step * 1e3)
    # a huge TTFT budget: prefill runs at its utilisation cap, of a 10% longer step
    cap_p = 0.9 / (1.1 * plain.prefill_s(10))
    cap_d = 0.92 * 4 / (7 * 1.08 * step)
    assert p.requests_per_s == pytest.approx(min(cap_p, cap_d))
    assert base.requests_per_s == pytest.approx(min(0.95 / plain.prefill_s(10), 4 / (7 * step)))


def test_system_disagg_block_is_checked(tmp_path):
    assert load_system("h200_sxm").disagg["decode_occupancy"] == 0.92
    prof = json.loads(json.dumps(load_system("h200_sxm").to_dict()))
    prof["disagg"] = {"decode_ocupancy": 0.9}
    (tmp_path / "bad.json").write_text(json.dumps(prof))
    with pytest.raises(PlanError, match="bad disagg factor.*decode_ocupancy"):
        load_system(str(tmp_path / "bad.json"))


def test_known_models_by_name_with_or_without_org(tmp_path):
    assert load_model("nvidia/Llama-3.1-Nemotron-Nano-4B-v1.1") == load_model("llama-3.1-nemotron-nano-4b-v1.1")
    assert load_model("smollm2-135m-instruct").tied_embeddings
    for name in ("Llama-3.1-8B-Instruct", "meta-llama/Llama-3.1-70B-Instruct", "Qwen3-32B"):
        assert load_model(name).layers > 0
    cfg = tmp_path / "m"
    cfg.mkdir()
    (cfg / "config.json").write_text('{"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, '
                                     '"intermediate_size": 128, "vocab_size": 100}')
    m = load_model(str(cfg))
    assert (m.kv_heads, m.head_dim) == (4, 16)
    with pytest.raises(PlanError, match="unknown model"):
        load_model("no-such-model")
    with pytest.raises(PlanError, match="unknown system"):
        load_system("tpu_v9")


def test_synchronized_closed_loop_prefills_the_whole_batch_first():
    from bench.plan.perf import predict_agg_waves

    e = Engine(TINY, SYS, 1)
    p = predict_agg_waves(e, 4, 1, 100, 10)
    assert p.ttft_ms == pytest.approx(e.step_s(0, 0, 400, 100) * 1e3)  # 400 tokens fit one 8192 budget
    assert p.tpot_ms == pytest.approx(e.step_s(4, 105) * 1e3)
    assert p.request_latency_ms == pytest.approx(p.ttft_ms + 9 * p.tpot_ms)
