"""The Kubernetes actuator: the autoscaler sets `replicas` of the prefill, decode or agg
Deployment through its scale subresource, with the official `kubernetes` client.

Scale-up: `replicas` += n (PATCH .../deployments/NAME/scale). Scale-down of workers that are
still starting (pods not ready): `replicas` -= n at once; a ReplicaSet removes pods that are
not ready before ready ones. Scale-down of serving workers, one background retirement per
worker: find its pod (by pod IP, the address a worker advertises), drain it
(`POST /internal/drain`: out of rotation, streams finished, a prefill worker's held blocks
read or expired), mark it `controller.kubernetes.io/pod-deletion-cost: "-1000000"` (PATCH
.../pods/NAME), then `replicas` -= 1; the ReplicaSet deletes the cheapest pod, the drained
one, whose preStop drain then has nothing to wait for. One controller replica: the
Deployment's read-modify-write of `replicas` is serialised in this process only.

Needs RBAC (k8s/components/autoscaler/rbac.yaml): get/patch on deployments/scale, list and
patch on pods, in the namespace.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any
from urllib.parse import urlsplit

import httpx

from serve import protocol as p
from serve.auth import token_headers
from serve.autoscale.actuate import Action, ActionLog, Background, drain, now, pick_to_retire
from serve.autoscale.errors import AutoscaleError

log = logging.getLogger("pdserve.autoscale")
DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
RETIRE_COST = "-1000000"


def load_apis(kubeconfig: str | None = None) -> tuple[Any, Any]:
    """(AppsV1Api, CoreV1Api) from the pod's service account, else a kubeconfig."""
    try:
        from kubernetes import client, config
    except ImportError:
        raise AutoscaleError("--actuator kubernetes needs the kubernetes client: pip install 'pdserve[k8s]'") from None
    try:
        if kubeconfig:
            config.load_kube_config(config_file=kubeconfig)
        else:
            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
    except (config.ConfigException, OSError) as exc:
        raise AutoscaleError(f"no Kubernetes credentials (in-cluster or kubeconfig): {exc}") from None
    return client.AppsV1Api(), client.CoreV1Api()


class KubernetesActuator(ActionLog):
    name = "kubernetes"

    def __init__(self, apps: Any, core: Any, namespace: str, deployments: dict[str, str],
                 drain_timeout_s: float = 330.0, token: str | None = None, keep: int = 200) -> None:
        self.apps, self.core, self.namespace = apps, core, namespace
        self.deployments = dict(deployments)  # pool -> Deployment name
        self.drain_timeout_s, self.token = drain_timeout_s, token
        self.retiring: dict[str, set[str]] = {pool: set() for pool in deployments}
        self.lock = asyncio.Lock()  # one read-modify-write of a Deployment's replicas at a time
        self.background = Background()
        ActionLog.__init__(self, keep)
        self.closed = False

    async def _replicas(self, pool: str) -> tuple[int, str]:
        scale = await asyncio.to_thread(self.apps.read_namespaced_deployment_scale, self.deployments[pool],
                                        self.namespace)
        return int(scale.spec.replicas or 0), (scale.status.selector or "") if scale.status else ""

    async def _add(self, pool: str, delta: int) -> Action:
        """replicas += delta (delta may be negative), read and written under the lock."""
        name = self.deployments[pool]
        async with self.lock:
            replicas, _ = await self._replicas(pool)
            target = max(0, replicas + delta)
            await asyncio.to_thread(self.apps.patch_namespaced_deployment_scale, name, self.namespace,
                                    {"spec": {"replicas": target}})
        return self._record(Action(now(), pool, "scale", f"deployment/{name}", f"replicas {replicas} -> {target}"))

    async def starting(self, http: httpx.AsyncClient, rows: list[p.WorkerRow]) -> dict[str, int]:
        out: dict[str, int] = {}
        for pool in self.deployments:
            try:
                replicas, _ = await self._replicas(pool)
            except Exception as exc:  # the API server unreachable this interval: none starting
                log.warning("deployment %s: cannot read its scale: %s", self.deployments[pool], exc)
                continue
            serving = sum(1 for r in rows if r.role == pool and r.in_rotation)
            out[pool] = max(0, replicas - serving - len(self.retiring[pool]))
        return out

    async def apply(self, current: dict[str, int], desired: dict[str, int], rows: list[p.WorkerRow],
                    http: httpx.AsyncClient, starting: dict[str, int] | None = None) -> list[Action]:
        if self.closed:
            return []
        acts: list[Action] = []
        for pool, want in desired.items():
            if pool not in self.deployments:
                continue
            diff = want - current.get(pool, 0)
            if diff > 0:
                acts.append(await self._add(pool, diff))
            elif diff < 0:
                n = -diff
                unready = min(n, (starting or {}).get(pool, 0))
                if unready:  # the ReplicaSet removes pods that are not ready first: no drain needed
                    acts.append(await self._add(pool, -unready))
                    n -= unready
                for url in pick_to_retire(rows, pool, n, None):
                    if any(url in s for s in self.retiring.values()):
                        continue
                    self.retiring[pool].add(url)
                    acts.append(self._record(Action(now(), pool, "drain", url, "leaving rotation")))
                    self.background.spawn(self._retire(pool, url), f"retire {url}")
        return acts

    async def _pod_for(self, pool: str, url: str) -> str:
        _, selector = await self._replicas(pool)
        pods = await asyncio.to_thread(self.core.list_namespaced_pod, self.namespace, label_selector=selector)
        host = urlsplit(url).hostname
        for pod in pods.items:
            if pod.status is not None and pod.status.pod_ip == host:
                return pod.metadata.name
        raise AutoscaleError(f"no pod of deployment/{self.deployments[pool]} has the address of {url}")

    async def _retire(self, pool: str, url: str) -> None:
        try:
            pod = await self._pod_for(pool, url)
            async with httpx.AsyncClient(headers=token_headers(self.token)) as http:
                ok, what = await drain(http, url, self.drain_timeout_s)
            self._record(Action(now(), pool, "drained" if ok else "error", url, f"pod {pod}: {what}"))
            await asyncio.to_thread(self.core.patch_namespaced_pod, pod, self.namespace,
                                    {"metadata": {"annotations": {DELETION_COST: RETIRE_COST}}})
            self._record(Action(now(), pool, "mark", f"pod/{pod}", f"{DELETION_COST}={RETIRE_COST}"))
            await self._add(pool, -1)
        except Exception as exc:
            self._record(Action(now(), pool, "error", url, f"{type(exc).__name__}: {exc}"))
            raise
        finally:
            self.retiring[pool].discard(url)

    async def close(self) -> None:
        self.closed = True
        await self.background.wait(self.drain_timeout_s + 30.0)
