"""bench frontend-overhead's pure parts: py-spy's collapsed stacks summarised, and the
pdserve/vLLM ratios over passes."""

from bench.perf.frontend_overhead import ratios, summarise_stacks


def test_collapsed_stacks_become_self_and_inclusive_shares(tmp_path):
    f = tmp_path / "pyspy.txt"
    f.write_text("main (a.py:1);serve (b.py:2);send (c.py:3) 6\n"
                 "main (a.py:1);serve (b.py:2) 2\n"
                 "main (a.py:1);decode (d.py:4);send (c.py:3) 2\n"
                 "garbage line\n")
    s = summarise_stacks(f)
    assert s["samples"] == 10
    assert dict(s["self_percent"]) == {"send (c.py:3)": 80.0, "serve (b.py:2)": 20.0}
    incl = dict(s["inclusive_percent"])
    assert incl["main (a.py:1)"] == 100.0 and incl["serve (b.py:2)"] == 80.0 and incl["decode (d.py:4)"] == 20.0


def test_ratios_are_pdserve_over_vllm_means_of_the_passes():
    def run(server, c, tps, itl):
        return {"server": server, "concurrency": c, "output_tokens_per_s": tps, "itl_p50_ms": itl,
                "ttft_p50_ms": 100.0, "path_cpu_ms_per_request": 10.0}

    rows = ratios([run("vllm", 16, 100, 10), run("pdserve", 16, 90, 11), run("pdserve", 16, 100, 13),
                   run("vllm", 16, 100, 10), run("vllm", 32, 1, 1)], [16, 32])
    assert len(rows) == 1  # no pdserve run at 32: no ratio
    assert rows[0]["output_tokens_per_s_ratio"] == 0.95 and rows[0]["itl_p50_ms_ratio"] == 1.2
    profiled = {**run("pdserve", 16, 10, 99), "profiled": True}  # under py-spy: not in the ratios
    assert ratios([run("vllm", 16, 100, 10), run("pdserve", 16, 100, 10), profiled], [16])[0][
        "output_tokens_per_s_ratio"] == 1.0
