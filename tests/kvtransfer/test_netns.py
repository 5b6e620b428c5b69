"""KV transfer between two network namespaces over veth, `tcp` profile, each worker in its
own PID namespace (so UCX cannot use shared memory or cma): output still correct.

Needs root and iproute2 (`ip netns`), as CI has; the namespaces and addresses are this
test's own and are removed afterwards.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid

import pytest

from tests.helpers.procs import ENGINE_FLAGS, MODEL, Proc
from tests.helpers.workerclient import generate, metric, metrics, reset_prefix_cache

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("unshare") is None,
                       reason="needs root, iproute2 and unshare to create network/PID namespaces"),
]


def sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, timeout=30)


@pytest.fixture(scope="module")
def namespaces():
    tag = uuid.uuid4().hex[:5]
    ns = {"p": f"pdp{tag}", "d": f"pdd{tag}"}
    links = [f"pv{tag}{i}" for i in range(6)]
    try:
        for name in ns.values():
            sh("ip", "netns", "add", name)
            sh("ip", "-n", name, "link", "set", "lo", "up")
        # P <-> D directly (the KV path), plus root <-> each (HTTP from the test).
        plan = [(links[0], ns["p"], "10.213.3.1/24", links[1], ns["d"], "10.213.3.2/24"),
                (links[2], None, "10.213.1.1/24", links[3], ns["p"], "10.213.1.2/24"),
                (links[4], None, "10.213.2.1/24", links[5], ns["d"], "10.213.2.2/24")]
        for a, ans, aip, b, bns, bip in plan:
            sh("ip", "link", "add", a, "type", "veth", "peer", "name", b)
            for dev, where, ip in ((a, ans, aip), (b, bns, bip)):
                if where:
                    sh("ip", "link", "set", dev, "netns", where)
                    sh("ip", "-n", where, "addr", "add", ip, "dev", dev)
                    sh("ip", "-n", where, "link", "set", dev, "up")
                else:
                    sh("ip", "addr", "add", ip, "dev", dev)
                    sh("ip", "link", "set", dev, "up")
        yield ns
    finally:
        for link in (links[2], links[4]):
            subprocess.run(["ip", "link", "del", link], capture_output=True)
        for name in ns.values():
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


def ns_proc(name: str, netns: str, args: list[str]) -> Proc:
    """A pdserve process inside `netns` and a fresh PID namespace (no cma/shm to the peer)."""
    return Proc(name, args, env={"UCX_NET_DEVICES": "all"},
                wrapper=["ip", "netns", "exec", netns, "unshare", "--pid", "--fork", "--mount-proc"])


def test_transfer_across_namespaces_over_tcp(namespaces, model_dir, tokenizer):
    common = ["--served-model-name", MODEL, "--model", model_dir, "--kv-transport", "tcp", "--kv-cache-gib", "1",
              "--max-num-seqs", "4", "--max-model-len", "2048", "--host", "0.0.0.0", "--port", "8300", *ENGINE_FLAGS]
    p = ns_proc("netns-prefill", namespaces["p"], ["worker", "--role", "prefill", "--cpu-cores", "0",
                                                   "--advertise-host", "10.213.3.1", *common])
    d = ns_proc("netns-decode", namespaces["d"], ["worker", "--role", "decode", "--cpu-cores", "1",
                                                  "--advertise-host", "10.213.3.2", *common])
    purl, durl = "http://10.213.1.2:8300", "http://10.213.2.2:8300"
    try:
        p.wait_http(f"{purl}/health", 420)
        d.wait_http(f"{durl}/health", 420)
        text = "\n".join(f"Step {i}: add one to {i} and get {i + 1}." for i in range(1, 60))
        ids = tokenizer.encode(text, add_special_tokens=False)[:700]
        pre = generate(purl, ids, max_tokens=1, remote_decode=True)
        assert pre.kv_transfer["side_channel"].startswith("tcp://10.213.3.1:")
        out = generate(durl, ids, max_tokens=12, kv_transfer=pre.kv_transfer)
        m = metrics(durl)
        assert metric(m, "pdserve_kv_blocks_transferred_total") == 6
        assert metric(m, "pdserve_kv_recomputes_total") == 0
        reset_prefix_cache(durl)
        alone = generate(durl, ids, max_tokens=12)
        assert out.tokens == alone.tokens
        assert "transport=tcp" in d.log_path.read_text()
    finally:
        p.stop()
        d.stop()
