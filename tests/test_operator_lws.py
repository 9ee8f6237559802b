"""Multi-node worker pools as LeaderWorkerSets (operator/render_lws.py), chosen when the cluster serves the
LWS CRD (`RenderOptions.lws`: the operator's API discovery; `render --lws` / `simulate --lws` by hand).

* the rendered LeaderWorkerSet: size = nodes per group, replicas = groups, a leader template (gRPC port)
  and a worker template (none), the pod contract's K3SERVE_NODE_RANK / K3SERVE_LEADER_ADDR taken from
  LWS's own LWS_WORKER_INDEX / LWS_LEADER_ADDRESS; valid against the LWS project's CRD schema (v0.10.0,
  operator/testing/lws_schema.py), which rejects a broken object field by field;
* the LWS controller's pods as `operator simulate` plans them: names, labels, LWS_* first in the env, the
  contract variables resolving to each pod's rank and its group leader's IP, the router discovering leaders only;
* `k3serve operator simulate --lws --operator`: a TP=2 decode pool on 1-GPU nodes runs as one
  LeaderWorkerSet group of 2 pods, the real operator (against the API emulator with the LWS CRD) reports
  it Ready, greedy completions equal the offline TP=2 engine, and a killed worker pod recreates the group
  (RecreateGroupOnPodRestart), which serves the same tokens again.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from k3serve.operator import names as n
from k3serve.operator import render_lws
from k3serve.operator.render import render
from k3serve.operator.render_context import RenderOptions
from k3serve.operator.simulate_plan import Inputs, plan
from k3serve.operator.testing import lws_schema, validate
from tests._sim_group import (
    complete,
    complete_when,
    group_leader_ip,
    kill_pod,
    offline_completion,
    one_gpu_node_decode_cr,
)

ROOT = Path(__file__).resolve().parents[1]


def _sample(name: str) -> dict:
    cr = yaml.safe_load((ROOT / "manifests/samples" / name).read_text())
    cr["metadata"]["namespace"] = "demo"
    return cr


def _env(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container["env"]}


def _tp_on_one_gpu_nodes(tp: int) -> dict:
    """tiny-cpu.yaml with a decode pool of TP=`tp` on 1-GPU nodes (tp pods per group), no prefill, no store."""
    cr = one_gpu_node_decode_cr(tensorParallelSize=tp)
    cr["metadata"]["namespace"] = "demo"
    return cr


@pytest.mark.parametrize("tp,replicas", [(2, 1), (4, 3)])
def test_multi_node_pool_is_one_leaderworkerset_with_lws_env(tp, replicas):
    cr = _tp_on_one_gpu_nodes(tp)
    cr["spec"]["decode"]["replicas"] = replicas
    objs = render(cr, RenderOptions(lws=True)).objects
    (lws,) = [o for o in objs if o["kind"] == "LeaderWorkerSet"]
    assert not [o for o in objs if o["kind"] == "StatefulSet" and "decode" in o["metadata"]["name"]]
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1" and lws["metadata"]["name"] == "tiny-decode"
    spec = lws["spec"]
    lwt = spec["leaderWorkerTemplate"]
    assert spec["replicas"] == replicas and lwt["size"] == tp  # one pod per node, one GPU per node
    assert lwt["restartPolicy"] == "RecreateGroupOnPodRestart" and spec["networkConfig"]["subdomainPolicy"] == "Shared"
    leader, worker = lwt["leaderTemplate"]["spec"]["containers"][0], lwt["workerTemplate"]["spec"]["containers"][0]
    assert leader["args"] == worker["args"] and leader["env"] == worker["env"]
    assert {p["name"] for p in leader["ports"]} == {"grpc", "metrics"}
    assert {p["name"] for p in worker["ports"]} == {"metrics"}  # ranks only: no gRPC
    env = _env(leader)
    assert env["K3SERVE_NUM_NODES"]["value"] == str(tp)
    assert env["K3SERVE_NODE_RANK"]["value"] == "$(LWS_WORKER_INDEX)"
    assert env["K3SERVE_LEADER_ADDR"]["value"] == "$(LWS_LEADER_ADDRESS)"
    assert leader["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert lws_schema.errors(lws) == [] and validate.errors(lws) == []
    # without the CRD: one StatefulSet per group, the same contract from the pod index label
    plain = render(cr, RenderOptions(lws=False)).objects
    sets = [o for o in plain if o["kind"] == "StatefulSet" and o["metadata"]["name"].startswith("tiny-decode-")]
    assert len(sets) == replicas and all(s["spec"]["replicas"] == tp for s in sets)


def test_the_lws_crd_schema_rejects_a_broken_leaderworkerset():
    (lws,) = [o for o in render(_sample("k3-tep8-dep16.yaml"), RenderOptions(lws=True)).objects
              if o["kind"] == "LeaderWorkerSet"]
    assert validate.errors(lws) == []
    assert lws_schema.crd()["source"]["tag"] == "v0.10.0"
    broken = copy.deepcopy(lws)
    broken["spec"]["leaderWorkerTemplate"]["size"] = "2"
    broken["spec"]["leaderWorkerTemplate"]["restartPolicy"] = "Always"
    broken["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["containers"][0]["gpus"] = 1
    broken["spec"]["startupPolicy"] = "Whenever"
    broken["spec"]["groupSize"] = 2
    found = lws_schema.errors(broken)
    for needle in ("spec: unknown field(s) 'groupSize'",
                   "spec.leaderWorkerTemplate.size: '2' is not of type 'integer'",
                   "spec.leaderWorkerTemplate.restartPolicy: 'Always' is not one of",
                   "spec.leaderWorkerTemplate.leaderTemplate.spec.containers[0]: unknown field(s) 'gpus'",
                   "spec.startupPolicy: 'Whenever' is not one of"):
        assert any(needle in f for f in found), (needle, found)
    assert validate.errors(broken) == found


def test_simulate_plans_the_lws_controllers_pods(tmp_path):
    cr = _tp_on_one_gpu_nodes(2)
    cr["spec"]["decode"]["replicas"] = 2
    objects = render(cr, RenderOptions(podmonitor=True, lws=True)).objects
    pods = plan(objects, Inputs(namespace="demo", cluster_domain="cluster.local", secrets={},
                                claims={"k3-tiny-model": "/data"}), tmp_path)
    by = {p.name: p for p in pods}
    decode = [p for p in pods if p.workload == "LeaderWorkerSet/tiny-decode"]
    assert [p.name for p in decode] == ["tiny-decode-0", "tiny-decode-0-1", "tiny-decode-1", "tiny-decode-1-1"]
    for p in decode:
        group, index = (p.name.split("-")[2:] + ["0"])[:2]
        assert p.labels[render_lws.LABEL_GROUP_INDEX] == group and p.labels[n.LABEL_LWS_WORKER_INDEX] == index
        assert p.labels[render_lws.LABEL_SET_NAME] == "tiny-decode"
        names = [e["name"] for e in p.container["env"]]
        assert names[:3] == ["LWS_LEADER_ADDRESS", "LWS_GROUP_SIZE", "LWS_WORKER_INDEX"]  # the webhook's order
        leader = by[f"tiny-decode-{group}"]
        assert p.env["K3SERVE_NODE_RANK"] == index and p.env["K3SERVE_NUM_NODES"] == "2"
        assert p.env["K3SERVE_LEADER_ADDR"] == leader.ip != by[f"tiny-decode-{1 - int(group)}"].ip
        assert ("grpc" in p.ports) == (index == "0")
    router = next(p for p in pods if p.component == "router").argv
    workers = router[router.index("--workers") + 1].split(",")
    assert workers == [f"{by['tiny-decode-0'].ip}:50051", f"{by['tiny-decode-1'].ip}:50051"]  # leaders only


def test_operator_simulate_lws_group_serves_and_recreates_on_a_lost_node(tmp_path, tiny_model_dir):
    from _k8s_sim import start_simulation

    cr = _tp_on_one_gpu_nodes(2)
    cr["metadata"].pop("namespace")
    cr["spec"]["cache"].update(kvCacheMemory="8Mi", maxModelLen=512)
    sim = start_simulation(cr, tmp_path, model_dir=tiny_model_dir, operator=True, timeout=300,
                           extra_args=["--lws"])
    try:
        assert "operator status phase=Ready" in sim.output(), sim.output()
        group_leader_ip(sim, "tiny-decode-0", "tiny-decode-0-1")
        first = complete(sim)
        kill_pod(sim, "tiny-decode-0-1")
        again = complete_when(sim, "recreating group 0 of LeaderWorkerSet/tiny-decode with tiny-decode-0", 150)
        assert again is not None, sim.output()
    finally:
        sim.stop()
    assert sim.log("tiny-decode-0").count("ready grpc=") == 2  # the leader was recreated with its group
    assert first == again == offline_completion(tiny_model_dir, tensor_parallel_size=2)
