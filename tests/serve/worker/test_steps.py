"""Engine step records: the vLLM plugin's hook (`serve.step_hook`) on stand-ins for vLLM's
EngineCore and Scheduler, the worker's reader of its file (rotation, a half-written line),
and a live simulated worker's `GET /steps` and `pdserve_worker_step_seconds`."""

from __future__ import annotations

import asyncio
import json
import os
import time
from types import SimpleNamespace

from serve.sim.cluster import SimCluster
from serve.step_hook import StepWriter, batch_of, wrap_step
from serve.worker.steps import StepLog
from tests.serve.sim.test_cluster import complete, metric, metrics


def scheduler_output(new: list[tuple[str, int]], cached: list[tuple[str, int]], scheduled: dict[str, int]):
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, num_computed_tokens=c) for r, c in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[r for r, _ in cached],
                                              num_computed_tokens=[c for _, c in cached]),
        num_scheduled_tokens=scheduled, total_num_scheduled_tokens=sum(scheduled.values()))


def test_a_batch_is_read_as_decode_contexts_and_prefill_chunks():
    # A new prompt of 300 (32 cached), a chunk continuing at 512, two decodes; one request unscheduled.
    out = scheduler_output([("a", 32)], [("b", 512), ("c", 90), ("d", 516), ("e", 7)],
                           {"a": 268, "b": 256, "c": 1, "d": 1})
    assert batch_of(out) == ([91, 517], [[32, 268], [512, 256]])


def test_the_hook_records_each_step_that_ran_the_model(tmp_path):
    path = str(tmp_path / "steps.jsonl")
    last: dict = {"out": None}
    outputs = [scheduler_output([("a", 0)], [], {"a": 40}), scheduler_output([], [("a", 40)], {"a": 1}),
               scheduler_output([], [], {})]

    def step(self):  # vLLM's step: it schedules (the patched schedule stashes the output), then runs
        last["out"] = outputs.pop(0)
        time.sleep(0.002)
        return "outputs"

    timed = wrap_step(step, StepWriter(path), last)
    assert [timed(None) for _ in range(3)] == ["outputs"] * 3
    lines = [json.loads(x) for x in open(path)]
    assert [(r["d"], r["p"]) for r in lines] == [([], [[0, 40]]), ([41], [])]  # the empty step: no record
    assert all(r["s"] >= 0.002 and abs(r["t"] - time.time()) < 60 for r in lines)


def test_the_reader_follows_rotation_and_waits_for_a_whole_line(tmp_path):
    path = str(tmp_path / "steps.jsonl")
    seen: list[float] = []
    log = StepLog(path, keep=3, observe=seen.append)
    assert log.poll() == 0  # no file yet
    line = lambda i: json.dumps({"t": 100.0 + i, "s": 0.01 * i, "d": [i], "p": []}) + "\n"  # noqa: E731
    with open(path, "a") as f:
        f.write(line(1) + line(2)[:10])
    assert log.poll() == 1
    with open(path, "a") as f:
        f.write(line(2)[10:] + line(3))
    assert log.poll() == 2 and seen == [0.01, 0.02, 0.03]
    # The writer rotates: what it wrote before renaming is still read, then the new file.
    with open(path, "a") as f:
        f.write(line(4))
    os.replace(path, path + ".1")
    with open(path, "a") as f:
        f.write(line(5) + "not json\n")
    assert log.poll() == 2 and [r.d for r in log.records] == [[3], [4], [5]]  # keep=3
    assert [r.seq for r in log.since(3)] == [3, 4] and log.since(0)[0].seq == 2 and log.next_seq == 5
    log.remove_files()
    assert not os.path.exists(path) and not os.path.exists(path + ".1")


def test_a_simulated_worker_reports_its_modelled_steps(model_dir):
    async def run() -> None:
        async with SimCluster(model_dir, ["agg"], engine_flags=["--sim-step-model", "constant:0.002"]) as c:
            w = c.urls("agg")[0]
            await complete(c, "Why is the sky blue?", 5)
            r = (await c.client.get(f"{w}/steps")).json()
            assert r["engine"] == "sim" and r["simulated"] is True and r["role"] == "agg"
            steps = r["steps"]
            assert len(steps) >= 5 and r["next_seq"] == steps[-1]["seq"] + 1 and r["first_seq"] == 0
            assert all(s["s"] == 0.002 for s in steps)
            assert steps[0]["p"][0][0] == 0 and steps[0]["p"][0][1] > 1 and steps[0]["d"] == []  # the prompt
            assert [len(s["d"]) for s in steps[1:]] == [1] * (len(steps) - 1)  # then one decode a step
            later = (await c.client.get(f"{w}/steps", params={"since": r["next_seq"] - 1})).json()
            assert [s["seq"] for s in later["steps"]] == [r["next_seq"] - 1]
            m = await metrics(c, w)
            assert metric(m, "pdserve_worker_step_seconds_count", role="agg") == len(steps)

    asyncio.run(run())


def test_step_files_no_engine_writes_are_swept(tmp_path):
    from serve.worker.steps import sweep_dead

    live = StepWriter(str(tmp_path / "pdserve-steps-8101-11.jsonl"))  # an engine writing (it holds the lock)
    live.write(1.0, 0.01, [5], [])
    (tmp_path / "pdserve-steps-8101-11.jsonl.1").write_text("")
    left = ["pdserve-steps-8100-10.jsonl", "pdserve-steps-8100-10.jsonl.1"]  # a killed worker's
    for n in [*left, "other.jsonl"]:
        (tmp_path / n).write_text("")
    sweep_dead(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["other.jsonl", "pdserve-steps-8101-11.jsonl",
                                            "pdserve-steps-8101-11.jsonl.1"]
    live.f.close()  # the engine is gone: its file goes at the next sweep
    sweep_dead(str(tmp_path))
    assert os.listdir(tmp_path) == ["other.jsonl"]
