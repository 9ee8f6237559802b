"""The pure renderer: KimiK3Deployment -> Kubernetes objects, validated strictly, hardened, and
matching the component contract in docs/components.md."""

from __future__ import annotations

import copy
import os
import re

import pytest
import yaml

from k3serve import cli
from k3serve.operator import generate, quantity
from k3serve.operator import names as n
from k3serve.operator.apply import merge_patch, stamp
from k3serve.operator.render import render
from k3serve.operator.render_context import RenderOptions
from k3serve.operator.schema_defaults import apply_defaults
from k3serve.operator.testing import validate

ROOT = generate.repo_root()


def sample(
    name: str, namespace: str = "ns", uid: str | None = "3f1c0e52-0000-4000-8000-000000000001"
) -> dict:
    with open(os.path.join(ROOT, "manifests", "samples", name), encoding="utf-8") as f:
        cr = yaml.safe_load(f)
    cr["metadata"]["namespace"] = namespace
    if uid:
        cr["metadata"]["uid"] = uid
    return cr


def by_key(objects: list[dict]) -> dict[tuple[str, str], dict]:
    return {(o["kind"], o["metadata"]["name"]): o for o in objects}


def pod_templates(objects: list[dict]) -> list[tuple[str, dict]]:
    out = []
    for o in objects:
        if o["kind"] in ("StatefulSet", "Deployment"):
            out.append((o["metadata"]["name"], o["spec"]["template"]))
        elif o["kind"] == "LeaderWorkerSet":
            out.append((o["metadata"]["name"], o["spec"]["leaderWorkerTemplate"]["workerTemplate"]))
    return out


CASES = [
    ("tiny-cpu.yaml", False),
    ("tiny-cpu.yaml", True),
    ("k3-tep8-dep16.yaml", False),
    ("k3-tep8-dep16.yaml", True),
]


@pytest.mark.parametrize("name,lws", CASES)
def test_every_rendered_object_is_strictly_valid(name, lws):
    result = render(sample(name), RenderOptions(lws=lws))
    assert result.problems == [] and result.objects
    for obj in result.objects:
        assert validate.errors(obj) == [], obj["kind"]
        assert obj["metadata"]["namespace"] == "ns"
        assert obj["metadata"]["labels"][n.LABEL_DEPLOYMENT] == sample(name)["metadata"]["name"]


def test_tiny_cpu_objects():
    objs = by_key(render(sample("tiny-cpu.yaml")).objects)
    assert set(objs) == {
        ("ServiceAccount", "tiny-worker"),
        ("ServiceAccount", "tiny-router"),
        ("Role", "tiny-router"),
        ("RoleBinding", "tiny-router"),
        ("ConfigMap", "tiny-config"),
        ("Service", "tiny-prefill"),
        ("Service", "tiny-decode"),
        ("Service", "tiny-router"),
        ("Service", "tiny-kvstore"),
        ("StatefulSet", "tiny-prefill"),
        ("StatefulSet", "tiny-decode"),
        ("Deployment", "tiny-router"),
        ("Deployment", "tiny-kvstore"),
        ("PodDisruptionBudget", "tiny-prefill"),
        ("PodDisruptionBudget", "tiny-decode"),
        ("PodDisruptionBudget", "tiny-router"),
        ("NetworkPolicy", "tiny-internal"),
    }  # podMonitor: false in the sample
    decode = objs[("StatefulSet", "tiny-decode")]
    assert decode["spec"]["replicas"] == 1 and decode["spec"]["serviceName"] == "tiny-decode"
    res = decode["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert "nvidia.com/gpu" not in res.get("limits", {})  # CPU pool
    assert objs[("Service", "tiny-decode")]["spec"]["clusterIP"] == "None"


def test_production_without_lws_is_one_statefulset_per_decode_group():
    objs = by_key(render(sample("k3-tep8-dep16.yaml")).objects)
    for group in (0, 1):
        sts = objs[("StatefulSet", f"k3-decode-{group}")]
        assert sts["spec"]["replicas"] == 2  # DEP16 on 8-GPU nodes: two nodes per group
        assert objs[("Service", f"k3-decode-{group}")]["spec"]["selector"][n.LABEL_GROUP] == str(group)
        pod = sts["spec"]["template"]["spec"]
        container = pod["containers"][0]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
        env = {e["name"]: e for e in container["env"]}
        assert env["K3SERVE_NUM_NODES"]["value"] == "2"
        assert (
            env["K3SERVE_LEADER_ADDR"]["value"]
            == f"k3-decode-{group}-0.k3-decode-{group}.ns.svc.cluster.local"
        )
        assert n.LABEL_STS_POD_INDEX in env["K3SERVE_NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"]
        assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H200"}
    prefill = objs[("StatefulSet", "k3-prefill")]
    assert prefill["spec"]["replicas"] == 2  # TEP8 fits one node: one pod per group
    assert ("LeaderWorkerSet", "k3-decode") not in objs
    assert ("PodMonitor", "k3") in objs


def test_production_with_lws_is_one_leaderworkerset():
    objs = by_key(render(sample("k3-tep8-dep16.yaml"), RenderOptions(lws=True)).objects)
    lws = objs[("LeaderWorkerSet", "k3-decode")]
    assert lws["spec"]["replicas"] == 2 and lws["spec"]["leaderWorkerTemplate"]["size"] == 2
    assert lws["spec"]["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart"
    assert not any(k[0] == "StatefulSet" and k[1].startswith("k3-decode") for k in objs)
    router_args = objs[("Deployment", "k3-router")]["spec"]["template"]["spec"]["containers"][0]["args"]
    decode_sel = router_args[router_args.index("--decode-selector") + 1]
    assert f"{n.LABEL_LWS_WORKER_INDEX}=0" in decode_sel


def _flag(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def test_worker_router_and_store_command_lines_follow_the_contract():
    result = render(sample("k3-tep8-dep16.yaml"))
    objs = by_key(result.objects)
    prefill = objs[("StatefulSet", "k3-prefill")]["spec"]["template"]["spec"]["containers"][0]
    decode = objs[("StatefulSet", "k3-decode-0")]["spec"]["template"]["spec"]["containers"][0]
    for container, role, tp, dp in ((prefill, "prefill", "8", "1"), (decode, "decode", "1", "16")):
        args = container["args"]
        assert "command" not in container and args[0] == "worker"  # the image entrypoint is `k3serve`
        assert _flag(args, "--role") == role and _flag(args, "--model") == "hf://moonshotai/Kimi-K3"
        assert _flag(args, "--host") == "$(K3SERVE_POD_IP)"
        assert (_flag(args, "--grpc-port"), _flag(args, "--metrics-port")) == ("50051", "9100")
        assert (_flag(args, "--tensor-parallel-size"), _flag(args, "--data-parallel-size")) == (tp, dp)
        assert "--enable-expert-parallel" in args
        assert _flag(args, "--kv-store") == "k3-kvstore.ns.svc.cluster.local:50051"
        assert "--enable-prefix-caching" in args and "--prefix-cache-selective-retention" in args
        assert _flag(args, "--prefix-cache-eviction") == "compute-per-byte"
        assert _flag(args, "--prefix-cache-retention-interval") == "0"
        assert (_flag(args, "--kv-cache-memory"), _flag(args, "--max-model-len")) == ("0.9", "262144")
    router = objs[("Deployment", "k3-router")]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert (
        router[:8]
        == [
            "router",
            "--host",
            "$(K3SERVE_POD_IP)",
            "--port",
            "8000",
            "--metrics-port",
            "9100",
            "--discovery",
        ]
        and _flag(router, "--discovery") == "kubernetes"
    )
    assert _flag(router, "--prefill-selector") == "k3serve.io/deployment=k3,k3serve.io/role=prefill"
    assert _flag(router, "--decode-selector") == (
        "apps.kubernetes.io/pod-index=0,k3serve.io/deployment=k3,k3serve.io/role=decode"
    )
    assert _flag(router, "--policy") == "hybrid-prefix"
    assert _flag(router, "--api-key-file") == "/etc/k3serve/api-key/api-key"
    store = objs[("Deployment", "k3-kvstore")]["spec"]["template"]["spec"]["containers"][0]
    assert store["command"] == ["mooncake_master"] and "--rpc_port=50051" in store["args"]
    assert "--enable_http_metadata_server=false" in store["args"]
    # a CPU sample: PVC model path and byte-sized KV cache
    tiny = by_key(render(sample("tiny-cpu.yaml")).objects)
    args = tiny[("StatefulSet", "tiny-decode")]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert _flag(args, "--model") == "/models/tiny" and _flag(args, "--kv-cache-memory") == str(256 * 2**20)
    assert (_flag(args, "--block-size"), _flag(args, "--prefix-match-unit")) == ("64", "16")
    assert "--enable-expert-parallel" not in args


def test_router_selectors_select_exactly_the_group_leaders():
    for name, lws in CASES:
        result = render(sample(name), RenderOptions(lws=lws))
        router = by_key(result.objects)[("Deployment", f"{sample(name)['metadata']['name']}-router")]
        args = router["spec"]["template"]["spec"]["containers"][0]["args"]
        for flag, pool in (("--prefill-selector", "prefill"), ("--decode-selector", "decode")):
            wanted = dict(kv.split("=") for kv in _flag(args, flag).split(","))
            for tname, template in pod_templates(result.objects):
                labels = template["metadata"]["labels"]
                static = {
                    k: v
                    for k, v in wanted.items()
                    if k not in (n.LABEL_STS_POD_INDEX, n.LABEL_LWS_WORKER_INDEX)
                }
                assert (static.items() <= labels.items()) == (labels.get(n.LABEL_ROLE) == pool), tname
        assert result.decode_selector == _flag(args, "--decode-selector")


@pytest.mark.parametrize("name,lws", CASES)
def test_pods_are_hardened_and_probed(name, lws):
    for tname, template in pod_templates(render(sample(name), RenderOptions(lws=lws)).objects):
        spec = template["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert template["metadata"]["annotations"][n.ANN_CONFIG_HASH]
        for c in spec["containers"]:
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False, tname
            assert sc["capabilities"] == {"drop": ["ALL"]}
            ports = {p["name"]: p["containerPort"] for p in c["ports"]}
            assert ports["metrics"] == 9100
            for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
                assert c[probe]["httpGet"] == {"path": "/health", "port": "metrics"}, (tname, probe)
            mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
            assert "/tmp" in mounts and mounts["/etc/k3serve/config"]["readOnly"] is True
        if template["metadata"]["labels"][n.LABEL_ROLE] in ("prefill", "decode"):
            assert spec["automountServiceAccountToken"] is False


def _hashes(objects: list[dict]) -> dict[str, str]:
    return {name: t["metadata"]["annotations"][n.ANN_CONFIG_HASH] for name, t in pod_templates(objects)}


def test_config_hash_rolls_only_the_pods_whose_configuration_changed():
    base = sample("tiny-cpu.yaml")
    before = _hashes(render(base).objects)
    policy = copy.deepcopy(base)
    policy["spec"]["router"]["policy"] = "least-loaded"
    after = _hashes(render(policy).objects)
    assert {k for k in before if before[k] != after[k]} == {"tiny-router"}
    memory = copy.deepcopy(base)
    memory["spec"]["kvStore"]["memory"] = "1Gi"
    after = _hashes(render(memory).objects)
    assert {k for k in before if before[k] != after[k]} == {"tiny-prefill", "tiny-decode"}
    scaled = copy.deepcopy(base)
    scaled["spec"]["decode"]["replicas"] = 3
    assert _hashes(render(scaled).objects) != before  # the layout (replicas) is part of the pool config
    assert render(base).config_hash == render(copy.deepcopy(base)).config_hash


def test_owner_references_only_when_the_cr_has_a_uid():
    with_uid = render(sample("tiny-cpu.yaml"))
    for obj in with_uid.objects:
        (ref,) = obj["metadata"]["ownerReferences"]
        assert ref == {
            "apiVersion": "k3serve.io/v1alpha1",
            "kind": "KimiK3Deployment",
            "name": "tiny",
            "uid": "3f1c0e52-0000-4000-8000-000000000001",
            "controller": True,
            "blockOwnerDeletion": True,
        }
    assert all(
        "ownerReferences" not in o["metadata"] for o in render(sample("tiny-cpu.yaml", uid=None)).objects
    )


def test_unservable_or_invalid_specs_render_nothing():
    bad = sample("k3-tep8-dep16.yaml")
    bad["spec"]["decode"]["dataParallelSize"] = 12
    result = render(bad)
    assert result.objects == [] and "do not fill whole 8-GPU nodes" in result.problems[0]
    worse = sample("k3-tep8-dep16.yaml")
    worse["spec"]["router"]["policy"] = "fastest"
    result = render(worse)
    assert result.objects == [] and result.spec is None
    assert result.problems[0].startswith("invalid spec: spec.router.policy")


def test_colocated_mode_network_policy_and_missing_podmonitor_crd():
    cr = sample("k3-tep8-dep16.yaml")
    cr["spec"]["prefill"]["replicas"] = 0
    result = render(cr, RenderOptions(podmonitor=False))
    objs = by_key(result.objects)
    assert not any("prefill" in name for _, name in objs)
    decode = objs[("StatefulSet", "k3-decode-0")]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert _flag(decode, "--role") == "both"
    router = objs[("Deployment", "k3-router")]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--prefill-selector" not in router
    assert ("PodMonitor", "k3") not in objs and "PodMonitor CRD" in result.notes[0]
    policy = objs[("NetworkPolicy", "k3-internal")]["spec"]
    assert policy["podSelector"]["matchExpressions"][0]["values"] == ["decode", "kvstore"]
    assert policy["ingress"][0] == {"from": [{"podSelector": {"matchLabels": {n.LABEL_DEPLOYMENT: "k3"}}}]}
    assert policy["ingress"][1] == {"ports": [{"port": 9100, "protocol": "TCP"}]}


def test_contract_document_names_every_flag_and_variable_rendered():
    with open(os.path.join(ROOT, "docs", "components.md"), encoding="utf-8") as f:
        doc = f.read()
    seen_flags, seen_env = set(), set()
    for name, lws in CASES:
        for _, template in pod_templates(render(sample(name), RenderOptions(lws=lws)).objects):
            for c in template["spec"]["containers"]:
                seen_flags.update(re.sub(r"=.*", "", a) for a in c["args"] if a.startswith("--"))
                seen_env.update(e["name"] for e in c["env"])
    missing = sorted(f for f in seen_flags | seen_env if f not in doc)
    assert not missing, f"docs/components.md does not document: {missing}"


def test_render_command_prints_what_render_returns(tmp_path, capsys):
    path = tmp_path / "cr.yaml"
    cr = sample("tiny-cpu.yaml", namespace="demo", uid=None)
    path.write_text(yaml.safe_dump(cr))
    assert cli.main(["operator", "render", "-f", str(path)]) == 0
    printed = list(yaml.safe_load_all(capsys.readouterr().out))
    assert printed == render(cr).objects
    cr["spec"]["prefill"]["tensorParallelSize"] = 3
    cr["spec"]["model"]["architecture"]["kdaHeads"] = 4
    path.write_text(yaml.safe_dump(cr))
    assert cli.main(["operator", "render", "-f", str(path)]) == 1
    assert "tiny: spec.prefill.tensorParallelSize 3 does not divide" in capsys.readouterr().err


def test_merge_patch_three_way_semantics():
    live = {
        "metadata": {"labels": {"a": "1", "theirs": "x"}, "resourceVersion": "7"},
        "spec": {"replicas": 2, "selector": {"k": "v"}, "stale": 1},
    }
    desired = {"metadata": {"labels": {"a": "2"}}, "spec": {"replicas": 2, "selector": {"k": "v"}}}
    last = {"metadata": {"labels": {"a": "1"}}, "spec": {"replicas": 2, "selector": {"k": "v"}, "stale": 1}}
    assert merge_patch(live, desired, last) == {"metadata": {"labels": {"a": "2"}}, "spec": {"stale": None}}
    assert merge_patch(live, live, live) == {}
    stamped = stamp({"kind": "ConfigMap", "metadata": {"name": "x"}, "data": {"k": "v"}})
    again = stamp(stamped)
    assert again == stamped  # stamping is idempotent: the hash ignores its own annotations
    assert stamp({"kind": "ConfigMap", "metadata": {"name": "x"}, "data": {"k": "w"}}) != stamped


def test_quantities_and_defaults():
    assert quantity.to_bytes("64Gi") == 64 * 2**30 and quantity.to_bytes("1.5G") == 1_500_000_000
    assert (
        quantity.to_bytes(1024) == 1024
        and quantity.to_bytes("1e3") == 1000
        and quantity.to_bytes("500m") == 1
    )
    with pytest.raises(ValueError):
        quantity.parse("64 GiB")
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "object", "default": {}, "properties": {"b": {"type": "integer", "default": 3}}},
            "l": {
                "type": "array",
                "items": {"type": "object", "properties": {"c": {"type": "string", "default": "d"}}},
            },
        },
    }
    assert apply_defaults(schema, {"l": [{}]}) == {"a": {"b": 3}, "l": [{"c": "d"}]}
    assert apply_defaults(schema, {"a": {"b": 5}}) == {"a": {"b": 5}}


# --- the pod contract's security fields, read from docs/components.md (not from the renderer) ----------

def _contract_rows() -> dict[str, str]:
    with open(os.path.join(ROOT, "docs", "components.md"), encoding="utf-8") as f:
        section = f.read().split("## Common to every pod", 1)[1].split("\n## ", 1)[0]
    return {m.group(1): m.group(2) for m in re.finditer(r"^\| (\w[\w ]*?) \| (.+?) \|$", section, flags=re.M)}


def _all_pod_templates(objects: list[dict]) -> list[tuple[str, dict]]:
    out = []
    for o in objects:
        if o["kind"] in ("StatefulSet", "Deployment"):
            out.append((o["metadata"]["name"], o["spec"]["template"]))
        elif o["kind"] == "LeaderWorkerSet":
            lwt = o["spec"]["leaderWorkerTemplate"]
            out += [(f"{o['metadata']['name']}/{k}", lwt[k]) for k in ("leaderTemplate", "workerTemplate") if k in lwt]
    return out


# each phrase of the contract's `hardening` row and the check it means for (pod spec, container)
HARDENING = {
    "read-only root filesystem": lambda spec, c: c["securityContext"]["readOnlyRootFilesystem"] is True,
    "`allowPrivilegeEscalation: false`": lambda spec, c: c["securityContext"]["allowPrivilegeEscalation"] is False,
    "every capability dropped": lambda spec, c: c["securityContext"]["capabilities"] == {"drop": ["ALL"]},
    "seccomp `RuntimeDefault`": lambda spec, c: spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"},
    "`enableServiceLinks: false`": lambda spec, c: spec["enableServiceLinks"] is False,
}


@pytest.mark.parametrize("name,lws", CASES)
def test_pod_security_fields_are_the_documented_contract(name, lws):
    """User, group, fsGroup, hardening and writable paths of every rendered pod, each value taken from the
    `Common to every pod` table of docs/components.md (so dropping fsGroup or runAsUser from the renderer
    fails here, whatever the other tests render)."""
    rows = _contract_rows()
    uid = int(re.fullmatch(r"UID/GID (\d+), `runAsNonRoot`, `fsGroup` (\d+)", rows["user"]).group(1))
    fs_group = int(re.fullmatch(r"UID/GID (\d+), `runAsNonRoot`, `fsGroup` (\d+)", rows["user"]).group(2))
    phrases = [p.strip() for p in rows["hardening"].split(", ")]
    assert set(phrases) == set(HARDENING), f"docs/components.md hardening changed: {phrases}"
    writable = rows["writable paths"]
    assert "`/tmp` (emptyDir)" in writable and "`/var/cache/k3serve` (emptyDir" in writable
    assert "workers also `/dev/shm` (in-memory emptyDir" in writable
    templates = _all_pod_templates(render(sample(name), RenderOptions(lws=lws)).objects)
    assert len(templates) >= 4
    for tname, template in templates:
        spec = template["spec"]
        psc = spec["securityContext"]
        assert (psc["runAsUser"], psc["runAsGroup"], psc["runAsNonRoot"], psc["fsGroup"]) == \
            (uid, uid, True, fs_group), tname
        volumes = {v["name"]: v for v in spec["volumes"]}
        for c in spec["containers"]:
            for phrase, ok in HARDENING.items():
                assert ok(spec, c), (tname, phrase)
            mounts = {m["mountPath"]: volumes[m["name"]] for m in c["volumeMounts"]}
            assert "emptyDir" in mounts["/tmp"] and "emptyDir" in mounts["/var/cache/k3serve"], tname
            if template["metadata"]["labels"][n.LABEL_ROLE] in ("prefill", "decode"):
                assert mounts["/dev/shm"]["emptyDir"]["medium"] == "Memory", tname


def _worker_args(objects: list[dict], pool: str) -> list[str]:
    sts = by_key(objects)[("StatefulSet", f"tiny-{pool}")]
    return sts["spec"]["template"]["spec"]["containers"][0]["args"]


def test_engine_tier_fields_render_into_the_worker_flags():
    cr = sample("tiny-cpu.yaml")
    cr["spec"]["cache"]["offloadMemory"] = "8Gi"
    cr["spec"]["kvStore"]["deadlineMs"] = 30
    cr["spec"]["prefill"]["transferDevices"] = "mlx5_0:1,mlx5_1:1"
    cr["spec"]["decode"]["transferDevices"] = "eth0"
    result = render(cr)
    assert not result.problems, result.problems
    for pool, devices in (("prefill", "mlx5_0:1,mlx5_1:1"), ("decode", "eth0")):
        args = _worker_args(result.objects, pool)
        assert args[args.index("--kv-offload-memory") + 1] == str(8 * 2**30)
        assert args[args.index("--kv-store-deadline-ms") + 1] == "30"
        assert args[args.index("--kv-transfer-devices") + 1] == devices
    # colocated pods transfer nothing; without a store there is no store deadline; unset fields: no flags
    cr["spec"]["prefill"]["replicas"] = 0
    cr["spec"]["kvStore"]["enabled"] = False
    args = _worker_args(render(cr).objects, "decode")
    assert "--kv-transfer-devices" not in args and "--kv-store-deadline-ms" not in args
    cr = sample("tiny-cpu.yaml")
    for pool in ("prefill", "decode"):
        cr["spec"][pool].pop("transferDevices")
    args = _worker_args(render(cr).objects, "decode")
    assert not {"--kv-offload-memory", "--kv-store-deadline-ms", "--kv-transfer-devices"} & set(args)


@pytest.mark.parametrize(
    "path, value, needle",
    [
        (("cache", "offloadMemory"), "8GB", "spec.cache.offloadMemory"),
        (("cache", "offloadMemory"), "0", "spec.cache.offloadMemory"),
        (("kvStore", "deadlineMs"), 0, "spec.kvStore.deadlineMs"),
        (("kvStore", "deadlineMs"), 120000, "spec.kvStore.deadlineMs"),
        (("decode", "transferDevices"), "eth0; rm -rf", "spec.decode.transferDevices"),
    ],
)
def test_engine_tier_fields_are_validated_with_the_field_named(path, value, needle):
    cr = sample("tiny-cpu.yaml")
    cr["spec"][path[0]][path[1]] = value
    result = render(cr)
    assert result.objects == [] and any(needle in p for p in result.problems), result.problems


def test_offload_without_prefix_caching_is_refused():
    cr = sample("tiny-cpu.yaml")
    cr["spec"]["cache"].update(offloadMemory="1Gi", prefixCaching=False)
    cr["spec"]["cache"].pop("prefixMatchUnit")
    result = render(cr)
    assert result.objects == []
    assert any("spec.cache.offloadMemory (1Gi) needs spec.cache.prefixCaching" in p for p in result.problems)


def test_pd_geometry_is_checked_with_the_workers_own_mapping():
    cr = sample("tiny-cpu.yaml")
    for pool, tp in (("prefill", 4), ("decode", 2)):
        cr["spec"][pool].update(tensorParallelSize=tp, gpusPerNode=tp)
    cr["spec"]["model"]["architecture"].update(kdaHeads=6, mlaHeads=8)
    result = render(cr)
    assert result.objects == []
    assert "spec.prefill/spec.decode: prefill: tensor-parallel size 4 does not divide the 6 KDA heads" in result.problems


def test_model_uri_credentials_come_from_secrets_for_workers_and_router():
    cr = sample("tiny-cpu.yaml")
    cr["spec"]["model"] = {"uri": "hf://org/tiny", "revision": "v1", "name": "k3-tiny",
                           "architecture": cr["spec"]["model"]["architecture"]}
    token = {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}
    cr["spec"]["decode"]["env"] = [token, {"name": "HF_ENDPOINT", "value": "http://mirror:8080"}]
    cr["spec"]["router"]["env"] = [token]
    result = render(cr)
    assert result.problems == []
    for obj in result.objects:
        assert validate.errors(obj) == [], obj["kind"]
    objs = by_key(result.objects)
    decode = objs[("StatefulSet", "tiny-decode")]["spec"]["template"]["spec"]["containers"][0]
    router = objs[("Deployment", "tiny-router")]["spec"]["template"]["spec"]["containers"][0]
    for c in (decode, router):
        assert c["args"][c["args"].index("--model") + 1] == "hf://org/tiny"
        assert token in c["env"]
        assert all(m["mountPath"] != n.MODEL_DIR for m in c["volumeMounts"])  # no PVC with a URI
    env = {e["name"]: e.get("value") for e in decode["env"]}
    assert env["K3SERVE_MODEL_REVISION"] == "v1" and env["HF_ENDPOINT"] == "http://mirror:8080"
    cr["spec"]["router"]["env"] = [{"name": "HF_TOKEN", "valueFrom": {"configMapKeyRef": {"name": "x", "key": "y"}}}]
    assert any("spec.router.env" in p for p in render(cr).problems)


def test_env_value_and_value_from_together_are_refused():
    cr = sample("tiny-cpu.yaml")
    cr["spec"]["router"]["env"] = [{"name": "HF_TOKEN", "value": "x",
                                    "valueFrom": {"secretKeyRef": {"name": "hf", "key": "t"}}}]
    result = render(cr)
    assert result.objects == [] and "spec.router.env HF_TOKEN: set value or valueFrom, not both" in result.problems
