"""The Kubernetes actuator, through the official `kubernetes` client, against a recording
API server (real HTTP): the exact requests it sends for a decision, in order: method, path,
query, body, the deletion-cost annotation, and the drain of the worker it retires first."""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest

from serve import protocol as p
from serve.autoscale.errors import AutoscaleError
from serve.autoscale.kube import DELETION_COST, RETIRE_COST, KubernetesActuator

NS = "llm"
SELECTOR = {"prefill": "app.kubernetes.io/name=pdserve,app.kubernetes.io/component=prefill",
            "decode": "app.kubernetes.io/name=pdserve,app.kubernetes.io/component=decode"}


class FakeCluster:
    """An API server for the calls the actuator makes (deployments/NAME/scale, pods) and two
    worker pods (127.0.0.2, 127.0.0.3) answering POST /internal/drain; every request recorded."""

    def __init__(self, replicas: dict[str, int], drain_inflight: int = 0) -> None:
        self.replicas = {f"pdserve-{k}": v for k, v in replicas.items()}
        self.log: list[tuple[str, str, dict, object, str]] = []  # method, path, query, body, content type
        self.lock = threading.Lock()
        self.drain_inflight = drain_inflight
        self.servers = [self._serve("127.0.0.1"), self._serve("127.0.0.2"), self._serve("127.0.0.3")]

    def url(self, i: int) -> str:
        host, port = self.servers[i].server_address[:2]
        return f"http://{host}:{port}"

    def _serve(self, host: str) -> ThreadingHTTPServer:
        cluster = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):  # quiet
                pass

            def _do(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(n) if n else b""
                body = json.loads(raw) if raw else None
                parts = urlsplit(self.path)
                query = {k: v[0] for k, v in parse_qs(parts.query).items()}
                with cluster.lock:
                    cluster.log.append((self.command, parts.path, query, body,
                                        self.headers.get("Content-Type", "")))
                    status, reply = cluster.answer(self.command, parts.path, body, host)
                data = json.dumps(reply).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_PATCH = do_POST = _do

        srv = ThreadingHTTPServer((host, 0), Handler)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        return srv

    def answer(self, method: str, path: str, body, host: str):
        if path == "/internal/drain":
            return 200, {"drained": self.drain_inflight == 0, "active_requests": self.drain_inflight, "waited_s": 0.01}
        if path.startswith(f"/apis/apps/v1/namespaces/{NS}/deployments/") and path.endswith("/scale"):
            name = path.split("/")[-2]
            if method == "PATCH":
                self.replicas[name] = body["spec"]["replicas"]
            pool = name.removeprefix("pdserve-")
            return 200, {"apiVersion": "autoscaling/v1", "kind": "Scale",
                         "metadata": {"name": name, "namespace": NS},
                         "spec": {"replicas": self.replicas[name]},
                         "status": {"replicas": self.replicas[name], "selector": SELECTOR[pool]}}
        if path == f"/api/v1/namespaces/{NS}/pods" and method == "GET":
            pods = [{"metadata": {"name": f"decode-{i}", "namespace": NS}, "status": {"podIP": f"127.0.0.{i}"}}
                    for i in (2, 3)]
            return 200, {"apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": pods}
        if path.startswith(f"/api/v1/namespaces/{NS}/pods/") and method == "PATCH":
            return 200, {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": path.split("/")[-1],
                                                                          "namespace": NS}}
        return 404, {"kind": "Status", "status": "Failure", "code": 404}

    def close(self) -> None:
        for s in self.servers:
            s.shutdown()
            s.server_close()


@pytest.fixture
def cluster():
    c = FakeCluster({"prefill": 2, "decode": 2})
    yield c
    c.close()


def _apis(url: str):
    from kubernetes import client

    cfg = client.Configuration()
    cfg.host = url
    api = client.ApiClient(cfg)
    return client.AppsV1Api(api), client.CoreV1Api(api)


def _row(url: str, role: str, inflight: int, in_rotation: bool = True) -> p.WorkerRow:
    return p.WorkerRow(url=url, worker_id=f"{role}-x", role=role, in_rotation=in_rotation, inflight=inflight,
                       failures=0, static=False)


def test_a_decision_sends_exactly_these_requests(cluster):
    apps, core = _apis(cluster.url(0))
    act = KubernetesActuator(apps, core, NS, {"prefill": "pdserve-prefill", "decode": "pdserve-decode"},
                             drain_timeout_s=7.0, token="secret")
    busy, idle = cluster.url(1), cluster.url(2)  # decode pods 127.0.0.2 (3 streams) and 127.0.0.3 (none)
    rows = [_row("http://10.0.0.9:8100", "prefill", 0), _row("http://10.0.0.8:8100", "prefill", 1),
            _row(busy, "decode", 3), _row(idle, "decode", 0)]

    async def go():
        async with httpx.AsyncClient() as http:
            starting = await act.starting(http, rows)
            acts = await act.apply({"prefill": 2, "decode": 2}, {"prefill": 3, "decode": 1}, rows, http, starting)
            await act.close()
            return starting, acts
    starting, acts = asyncio.run(go())
    assert starting == {"prefill": 0, "decode": 0}
    assert [(a.pool, a.kind) for a in acts] == [("prefill", "scale"), ("decode", "drain")] and acts[1].target == idle
    scale = {name: f"/apis/apps/v1/namespaces/{NS}/deployments/{name}/scale" for name in ("pdserve-prefill",
                                                                                          "pdserve-decode")}
    sent = [(m, path, q, body) for m, path, q, body, _ in cluster.log]
    assert sent == [
        # starting(): each pool's replicas
        ("GET", scale["pdserve-prefill"], {}, None),
        ("GET", scale["pdserve-decode"], {}, None),
        # prefill 2 -> 3: read, then write replicas through the scale subresource
        ("GET", scale["pdserve-prefill"], {}, None),
        ("PATCH", scale["pdserve-prefill"], {}, {"spec": {"replicas": 3}}),
        # decode 2 -> 1: the idle worker's pod found by its address, drained, marked, then replicas - 1
        ("GET", scale["pdserve-decode"], {}, None),
        ("GET", f"/api/v1/namespaces/{NS}/pods", {"labelSelector": SELECTOR["decode"]}, None),
        ("POST", "/internal/drain", {"timeout": "7.0"}, None),
        ("PATCH", f"/api/v1/namespaces/{NS}/pods/decode-3", {},
         {"metadata": {"annotations": {DELETION_COST: RETIRE_COST}}}),
        ("GET", scale["pdserve-decode"], {}, None),
        ("PATCH", scale["pdserve-decode"], {}, {"spec": {"replicas": 1}}),
    ]
    patch_types = {ct for m, _, _, _, ct in cluster.log if m == "PATCH"}
    assert patch_types <= {"application/merge-patch+json", "application/strategic-merge-patch+json"}, patch_types
    assert cluster.replicas == {"pdserve-prefill": 3, "pdserve-decode": 1}
    assert [a.kind for a in act.actions] == ["scale", "drain", "drained", "mark", "scale"]


def test_workers_still_starting_go_first_without_a_drain_and_count_as_starting(cluster):
    apps, core = _apis(cluster.url(0))
    act = KubernetesActuator(apps, core, NS, {"decode": "pdserve-decode"}, drain_timeout_s=5.0)
    cluster.replicas["pdserve-decode"] = 4  # 2 serving, 2 pods not ready yet
    rows = [_row(cluster.url(1), "decode", 0), _row(cluster.url(2), "decode", 0)]

    async def go():
        async with httpx.AsyncClient() as http:
            starting = await act.starting(http, rows)
            await act.apply({"decode": 4}, {"decode": 3}, rows, http, starting)
            await act.close()
            return starting
    assert asyncio.run(go()) == {"decode": 2}
    assert not any(path == "/internal/drain" for _, path, *_ in cluster.log)  # a ReplicaSet removes unready pods first
    assert cluster.replicas["pdserve-decode"] == 3


def test_a_worker_whose_pod_cannot_be_found_is_not_drained(cluster):
    apps, core = _apis(cluster.url(0))
    act = KubernetesActuator(apps, core, NS, {"decode": "pdserve-decode"}, drain_timeout_s=5.0)
    rows = [_row("http://10.9.9.9:8100", "decode", 0), _row(cluster.url(1), "decode", 5)]

    async def go():
        async with httpx.AsyncClient() as http:
            await act.apply({"decode": 2}, {"decode": 1}, rows, http, {"decode": 0})
            await act.close()
    asyncio.run(go())
    assert not any(path == "/internal/drain" for _, path, *_ in cluster.log)
    assert cluster.replicas["pdserve-decode"] == 2  # nothing removed that was not drained
    (err,) = [a for a in act.actions if a.kind == "error"]
    assert "no pod of deployment/pdserve-decode" in err.detail and not act.retiring["decode"]


def test_no_credentials_is_one_clear_error(tmp_path, monkeypatch):
    from serve.autoscale.kube import load_apis

    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "none"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(AutoscaleError, match="no Kubernetes credentials"):
        load_apis(str(tmp_path / "none"))
