"""The `cpu` overlay's own commands, run as local processes: its model-cache Job, the init
containers, the frontend and the prefill and decode workers (commands, args and env taken
from the rendered manifests) serve a chat request disaggregated, and the preStop drain lets
an in-flight stream finish while the worker leaves rotation.

What changes between a pod and this machine, and nothing else:
- addresses: the pod IP is 127.0.0.1 and `0.0.0.0` binds become 127.0.0.1 (loopback only);
- ports: every container port gets a free local port (pods each have their own IP; the KV
  side channel and KV events ports are picked by the worker itself);
- the discovery Service name becomes `localhost` (still resolved through DNS, dns+http);
- the PVC mount /models becomes a temporary directory;
- each worker is pinned to its own core (the pods' Guaranteed CPUs).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest

from tests.conftest import ROOT, Proc, free_port
from tests.k8s.manifests import by_kind, env_of, expand, render
from tests.helpers.workerclient import metric, metrics, stream_in_background, wait_for

pytestmark = pytest.mark.engine

PORT_FLAGS = ("--port", "--kv-side-channel-port", "--kv-events-port")
# Ports the worker binds itself late (its engine binds them after loading): 0 lets it pick a
# free one then, instead of one chosen here that another engine may take meanwhile.
LATE_BOUND = ("--kv-side-channel-port", "--kv-events-port")
# What `kubectl create secret` would hold (see the manifests' comments).
SECRETS = {("pdserve-cluster-token", "token"): uuid.uuid4().hex, ("pdserve-api-keys", "keys"): "sk-" + uuid.uuid4().hex}
TOKEN = {"x-pdserve-token": SECRETS[("pdserve-cluster-token", "token")]}
KEY = {"authorization": "Bearer " + SECRETS[("pdserve-api-keys", "keys")]}


class Pod:
    """One rendered container, translated to a local process."""

    def __init__(self, docs: list[dict], deployment: str, models: Path, core: int | None = None,
                 frontend_port: int | None = None) -> None:
        spec = by_kind(docs, "Deployment")[deployment]["spec"]["template"]["spec"] \
            if deployment != "pdserve-model-cache" else by_kind(docs, "Job")[deployment]["spec"]["template"]["spec"]
        self.spec = spec
        self.container = spec["containers"][0]
        self.name = deployment
        self.ports: dict[int, int] = {}
        self.env = self._env(self.container, docs, models, core, frontend_port)

    def _env(self, c: dict, docs: list[dict], models: Path, core: int | None, frontend_port: int | None) -> dict:
        raw = env_of(c, docs)
        env: dict[str, str] = {}
        for k, v in raw.items():
            if isinstance(v, dict) and "secretKeyRef" in v:
                ref = v["secretKeyRef"]
                v = SECRETS[(ref["name"], ref["key"])]
            elif isinstance(v, dict):  # downward API
                v = {"metadata.uid": str(uuid.uuid4()), "status.podIP": "127.0.0.1"}[v["fieldRef"]["fieldPath"]]
            env[k] = expand(str(v), env)
        for k, v in env.items():
            v = v.replace("/models", str(models))
            if k == "PDSERVE_HOST" and v == "0.0.0.0":
                v = "127.0.0.1"
            if k == "PDSERVE_FRONTEND":
                assert v == "dns+http://pdserve-frontend-discovery:8000", v
                v = f"dns+http://localhost:{frontend_port}"
            env[k] = v
        if core is not None:
            env["PDSERVE_CPU_CORES"] = str(core)
        env["HOME"] = str(models / "home")
        return env

    def argv(self, c: dict | None = None) -> list[str]:
        c = c or self.container
        assert c["command"] == ["pdserve"]
        out = []
        args = [expand(a, self.env) for a in c["args"]]
        for i, a in enumerate(args):
            if i and args[i - 1] in LATE_BOUND:
                a = "0"
            elif i and args[i - 1] in PORT_FLAGS:
                port = self.ports.setdefault(int(a), free_port())
                a = str(port)
            elif a == "0.0.0.0":
                a = "127.0.0.1"
            out.append(a)
        return out

    def run_init(self) -> None:
        for c in self.spec.get("initContainers", []):
            r = subprocess.run([sys.executable, "-m", "serve.cli", *self.argv(c)], cwd=ROOT, env={**os.environ, **self.env},
                               capture_output=True, text=True, timeout=600)
            assert r.returncode == 0, f"{self.name}/{c['name']}: {r.stdout}{r.stderr}"

    def start(self) -> Proc:
        self.run_init()
        self.proc = Proc(f"k8s-{self.name}", self.argv(), env=self.env)
        return self.proc

    @property
    def url(self) -> str:
        port = next(p for p in self.container["ports"] if p["name"] == "http")["containerPort"]
        return f"http://127.0.0.1:{self.ports[port]}"

    def probe(self, kind: str) -> str:
        return self.url + self.container[kind]["httpGet"]["path"]

    def _local(self, arg: str) -> str:
        for pod_port, port in self.ports.items():
            arg = arg.replace(f"127.0.0.1:{pod_port}", f"127.0.0.1:{port}")
        return arg

    def pre_stop(self) -> subprocess.CompletedProcess:
        cmd = self.container["lifecycle"]["preStop"]["exec"]["command"]
        assert cmd[0] == "pdserve"
        cmd = [self._local(a) for a in cmd[1:]]
        return subprocess.run([sys.executable, "-m", "serve.cli", *cmd], cwd=ROOT, env={**os.environ, **self.env},
                              capture_output=True, text=True, timeout=self.spec["terminationGracePeriodSeconds"])


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=3).status_code == 200
    except httpx.HTTPError:
        return False


def test_cpu_overlay_commands_serve_a_chat_request_and_drain(tmp_path, model_dir):
    import shutil

    docs = render("cpu")
    models = tmp_path / "models"
    # The model-cache Job's command runs against the (here: temporary) shared cache, found
    # filled as every pod after the first finds it: the conversion itself is
    # tests/serve/test_model.py's (30-40 s that this suite's engine path need not pay twice).
    shutil.copytree(model_dir, models / "pdserve" / "models" / "smollm2-135m-instruct")
    job = Pod(docs, "pdserve-model-cache", models)
    r = subprocess.run([sys.executable, "-m", "serve.cli", *job.argv()], cwd=ROOT, env={**os.environ, **job.env},
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert (models / "pdserve" / "models" / "smollm2-135m-instruct" / "config.json").is_file()

    fe = Pod(docs, "pdserve-frontend", models)
    pods = [fe]
    try:
        fe.start()
        wait_for(lambda: ok(fe.probe("livenessProbe")), 120, "frontend live")
        assert not ok(fe.probe("readinessProbe"))  # no worker yet: not ready
        port = fe.ports[8000]
        prefill = Pod(docs, "pdserve-prefill", models, core=0, frontend_port=port)
        decode = Pod(docs, "pdserve-decode", models, core=1, frontend_port=port)
        pods += [prefill, decode]
        for w in (prefill, decode):
            w.start()
        for w in (prefill, decode):
            w.proc.wait_http(w.probe("readinessProbe"), 420)
        # Both registered through DNS discovery, under their pod identity.
        wait_for(lambda: ok(fe.probe("readinessProbe")) and len(httpx.get(f"{fe.url}/internal/workers", headers=TOKEN).json()
                                                                 ["workers"]) == 2, 60, "both workers registered")
        ids = {w["worker_id"] for w in httpx.get(f"{fe.url}/internal/workers", headers=TOKEN).json()["workers"]}
        assert {i.split("-", 1)[0] for i in ids} == {"prefill", "decode"}
        assert ids == {prefill.env["PDSERVE_WORKER_ID"], decode.env["PDSERVE_WORKER_ID"]}

        body = {"model": "smollm2-135m-instruct", "temperature": 0, "max_tokens": 20,
                "messages": [{"role": "user", "content": "What is the capital of France?"}]}
        # The API key from the Secret guards the OpenAI endpoints; the cluster token is no key.
        for bad in ({}, TOKEN, {"authorization": "Bearer wrong"}):
            r = httpx.post(f"{fe.url}/v1/chat/completions", json=body, headers=bad, timeout=10)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
        assert httpx.get(f"{decode.url}/load", timeout=10).status_code == 401  # worker endpoints need the token
        resp = httpx.post(f"{fe.url}/v1/chat/completions", json=body, headers=KEY, timeout=120)
        assert resp.status_code == 200, resp.text
        assert "Paris" in resp.json()["choices"][0]["message"]["content"]
        assert metric(metrics(fe.url), "pdserve_frontend_request_paths_total", path="disagg") >= 1
        assert metric(metrics(decode.url), "pdserve_kv_reads_total") >= 1  # KV came from the prefill pod
        # (the KV side channel checked the cluster token's HMAC of the decode engine's id)

        # preStop on the decode worker while a stream is in flight: it leaves rotation, the
        # stream finishes, then the hook returns.
        t, lines, started = stream_in_background(fe.url, {**body, "max_tokens": 48, "ignore_eos": True,
                                                          "stream_options": {"include_usage": True}}, KEY)
        assert started.wait(60)
        t0 = time.monotonic()
        hook = decode.pre_stop()
        assert hook.returncode == 0 and "drained" in hook.stdout, hook.stdout + hook.stderr
        t.join(60)
        assert lines[-1] == "[DONE]" and not any('"error"' in x for x in lines), lines[-4:]
        assert json.loads(lines[-2])["usage"]["completion_tokens"] == 48  # the whole answer (detokenized
        # chunks may carry several tokens, so count tokens, not chunks)
        assert time.monotonic() - t0 < 60
        assert not ok(decode.probe("readinessProbe"))  # draining: out of the Service too
        roles = [w["role"] for w in httpx.get(f"{fe.url}/internal/workers", headers=TOKEN).json()["workers"]]
        assert roles == ["prefill"]  # deregistered, not waiting for a lease to run out

        # preStop on the frontend: out of readiness at once, then idle after its settle time.
        hook_fe: list[subprocess.CompletedProcess] = []
        th = threading.Thread(target=lambda: hook_fe.append(fe.pre_stop()))
        th.start()
        wait_for(lambda: httpx.get(fe.probe("readinessProbe"), timeout=3).status_code == 503, 10, "frontend draining")
        assert httpx.get(fe.probe("livenessProbe"), timeout=3).status_code == 200  # draining is not dead
        th.join(60)
        assert hook_fe and hook_fe[0].returncode == 0 and "drained" in hook_fe[0].stdout, hook_fe

        # SIGTERM: every process exits within its pod's grace period, nothing left behind.
        for p in reversed(pods):
            grace = p.spec["terminationGracePeriodSeconds"]
            t0 = time.monotonic()
            p.proc.popen.send_signal(signal.SIGTERM)
            p.proc.popen.wait(timeout=grace)
            assert time.monotonic() - t0 < grace
            # the engine-core children went with it
            wait_for(lambda p=p: not _group_alive(p.proc.pid), 30, f"{p.name}'s process group to exit")
    finally:
        for p in pods:
            if hasattr(p, "proc"):
                p.proc.stop()
