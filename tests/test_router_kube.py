"""Kubernetes discovery of worker pods (router/kube.py) against the API emulator the operator tests use.

The emulator (operator/testing/emulator.py) stores pods but runs no kubelet and ignores label selectors,
so the test writes the pods' status itself and includes foreign pods the router must not pick up. The
registry follows: Ready pods with matching labels join (at their `grpc` container port), pods that lose
readiness or are deleted leave, prefill and decode roles come from the selector that matched.
"""

import asyncio
import os

import pytest
from kubernetes import client, config

from k3serve.operator.testing.emulator import EmulatorThread
from k3serve.router.kube import KubernetesDiscovery, parse_selector
from k3serve.router.prefix_index import PrefixIndex
from k3serve.router.registry import Registry

NS = "serving"
DEC = "k3serve.io/deployment=demo,k3serve.io/role=decode"
PRE = "k3serve.io/deployment=demo,k3serve.io/role=prefill"


def _pod(name, role, ip, *, ready=True, deployment="demo", port=50051):
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": NS,
                     "labels": {"k3serve.io/deployment": deployment, "k3serve.io/role": role}},
        "spec": {"containers": [{"name": "worker", "image": "x",
                                 "ports": [{"name": "grpc", "containerPort": port}]}]},
        "status": {"phase": "Running", "podIP": ip,
                   "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    with EmulatorThread() as emu:
        path = emu.kubeconfig(str(tmp_path_factory.mktemp("k") / "kubeconfig"))
        old = os.environ.get("KUBECONFIG")
        os.environ["KUBECONFIG"] = path  # the router loads it like a kubectl user would
        config.load_kube_config(config_file=path)
        try:
            yield client.CoreV1Api()
        finally:
            if old is None:
                os.environ.pop("KUBECONFIG", None)
            else:
                os.environ["KUBECONFIG"] = old


def test_parse_selector():
    assert parse_selector("a=b, c==d") == {"a": "b", "c": "d"}
    with pytest.raises(ValueError):
        parse_selector("a")


def test_discovery_follows_ready_labelled_pods(api):
    api.create_namespaced_pod(NS, _pod("demo-decode-0", "decode", "10.0.0.1"))
    api.create_namespaced_pod(NS, _pod("demo-decode-1", "decode", "10.0.0.2", ready=False))
    api.create_namespaced_pod(NS, _pod("demo-prefill-0", "prefill", "10.0.0.3", port=50052))
    api.create_namespaced_pod(NS, _pod("other-decode-0", "decode", "10.0.0.9", deployment="other"))

    async def scenario():
        reg = Registry(PrefixIndex(), health_interval=30)
        d = KubernetesDiscovery(reg, namespace=NS, decode_selector=DEC, prefill_selector=PRE, interval=0.1)
        await d.start()
        try:
            first = {a: w.role for a, w in reg.workers.items()}
            api.patch_namespaced_pod("demo-decode-1", NS, {"status": {"conditions": [{"type": "Ready",
                                                                                      "status": "True"}]}})
            api.delete_namespaced_pod("demo-prefill-0", NS)
            for _ in range(100):
                await asyncio.sleep(0.05)
                if set(reg.workers) == {"10.0.0.1:50051", "10.0.0.2:50051"}:
                    break
            second = {a: w.role for a, w in reg.workers.items()}
        finally:
            await d.stop()
            await reg.close()
        colocated = Registry(PrefixIndex(), health_interval=30)
        d2 = KubernetesDiscovery(colocated, namespace=NS, decode_selector=DEC)
        await d2.start()
        roles = {a: w.role for a, w in colocated.workers.items()}
        await d2.stop()
        await colocated.close()
        return first, second, roles

    first, second, roles = asyncio.run(scenario())
    assert first == {"10.0.0.1:50051": "decode", "10.0.0.3:50052": "prefill"}
    assert second == {"10.0.0.1:50051": "decode", "10.0.0.2:50051": "decode"}
    assert roles == {"10.0.0.1:50051": "both", "10.0.0.2:50051": "both"}  # no prefill selector: colocated
