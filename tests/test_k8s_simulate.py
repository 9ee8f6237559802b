"""The rendered pods of manifests/samples/tiny-cpu.yaml run: `k3serve operator simulate` starts every
pod's container args + env as processes (pod IPs on loopback, Services to their pods, ConfigMaps and the
PVC as files), in a private network namespace because the Mooncake master and its clients run, waits for
every readiness probe, and the official `openai` client drives status.gatewayURL: chat, stream, tools;
greedy output equals the offline engine on the same checkpoint.

Both layouts run: colocated (prefill.replicas 0: decode pods with --role both) and the sample as
shipped (1 prefill + 1 decode + store, P/D over NIXL). Plan-level checks (no processes) come first: Service names, `$(VAR)` expansion, sandboxed mounts, the
router's discovery and the Prometheus targets.
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import openai
import pytest
import yaml

from k3serve.operator.render import render
from k3serve.operator.render_context import RenderOptions
from k3serve.operator.simulate_plan import (
    Inputs,
    SimulateError,
    expand,
    plan,
    prometheus_config,
    rewrite_hosts,
)

from ._k8s_sim import release, sample, shared_simulation

NAME = "k3-tiny"  # spec.model.name of the sample
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]


def pd_cr() -> dict:
    """tiny-cpu.yaml as shipped (1 prefill + 1 decode + the store) with the PodMonitor on, and a KV
    cache small enough that tests/test_prometheus_dashboards.py can fill it."""
    cr = sample()
    cr["spec"]["monitoring"]["podMonitor"] = True
    cr["spec"]["cache"]["maxModelLen"] = 1024
    cr["spec"]["cache"]["kvCacheMemory"] = "4Mi"  # 27 pages of 64 tokens: concurrent load preempts
    return cr


def colocated_cr() -> dict:
    """The same with prefill.replicas 0: the decode pods run --role both and take whole requests."""
    cr = pd_cr()
    cr["spec"]["prefill"]["replicas"] = 0
    return cr


SCENARIOS = {
    "colocated": (colocated_cr, ["tiny-decode-0", "tiny-router-sim0", "tiny-kvstore-sim0"]),
    "pd": (pd_cr, ["tiny-prefill-0", "tiny-decode-0", "tiny-router-sim0", "tiny-kvstore-sim0"]),
}


# --- the plan ---------------------------------------------------------------------------------------


def _plan(cr: dict, tmp_path: Path, lws: bool = False, **inputs):
    cr = copy.deepcopy(cr)
    cr["metadata"]["namespace"] = "demo"
    r = render(cr, RenderOptions(podmonitor=True, lws=lws))
    assert not r.problems
    kw = dict(namespace="demo", cluster_domain="cluster.local", secrets={}, claims={"k3-tiny-model": "/data"})
    kw.update(inputs)
    return r.objects, plan(r.objects, Inputs(**kw), tmp_path)


def test_plan_maps_services_env_and_mounts(tmp_path):
    cr = sample()
    cr["spec"]["monitoring"]["podMonitor"] = True
    objects, pods = _plan(cr, tmp_path)
    by = {p.name: p for p in pods}
    assert set(by) == {"tiny-prefill-0", "tiny-decode-0", "tiny-router-sim0", "tiny-kvstore-sim0"}
    assert len({p.ip for p in pods}) == len(pods) and all(p.ip.startswith("127.100.0.") for p in pods)
    dec, store = by["tiny-decode-0"], by["tiny-kvstore-sim0"]
    args = dec.argv[3:]
    assert dec.argv[1:3] == ["-m", "k3serve.cli"] and args[:3] == ["worker", "--role", "decode"]
    # $(K3SERVE_POD_IP) expanded, the store's Service name leads to the store pod's rpc port
    assert args[args.index("--host") + 1] == dec.ip
    assert args[args.index("--kv-store") + 1] == f"{store.ip}:50051"
    assert dec.env["MC_TCP_BIND_ADDRESS"] == dec.ip and dec.env["K3SERVE_POD_NAME"] == "tiny-decode-0"
    # mounts: the PVC at /models, the config file and $K3SERVE_HOME inside the pod's sandbox
    box = tmp_path / "pods/tiny-decode-0"
    assert args[args.index("--model") + 1] == str(box / "fs/models/tiny")
    assert dec.links == {"fs/models": "/data"}
    assert dec.env["K3SERVE_HOME"] == str(box / "fs/var/cache/k3serve")
    cfg = json.loads(dec.files["fs/etc/k3serve/config/decode.json"])
    assert cfg["role"] == "decode" and cfg["args"][:3] == ["worker", "--role", "decode"]
    assert dec.ready_url == f"http://{dec.ip}:9100/health" and dec.env["OMP_NUM_THREADS"] == "1"
    # the store: `command: [mooncake_master]`, the executable next to this Python
    assert store.argv[0].endswith("/mooncake_master") and f"--rpc_address={store.ip}" in store.argv
    # the router: static discovery of exactly the pods its selectors match
    router = by["tiny-router-sim0"].argv
    assert router[router.index("--discovery") + 1] == "static" and "--decode-selector" not in router
    assert router[router.index("--prefill-workers") + 1] == f"{by['tiny-prefill-0'].ip}:50051"
    assert router[router.index("--decode-workers") + 1] == f"{dec.ip}:50051"
    # Prometheus: one target per pod with the PodMonitor's target labels
    prom = json.loads(prometheus_config(objects, pods, "demo", "1s"))
    targets = {t["labels"]["pod"]: t for job in prom["scrape_configs"] for t in job["static_configs"]}
    assert set(targets) == set(by)
    assert targets["tiny-decode-0"]["targets"] == [f"{dec.ip}:9100"]
    assert targets["tiny-decode-0"]["labels"]["k3serve_io_role"] == "decode"
    assert targets["tiny-decode-0"]["labels"]["k3serve_io_deployment"] == "tiny"


def test_plan_secrets_and_missing_inputs(tmp_path):
    cr = sample("k3-tep8-dep16.yaml")
    with pytest.raises(SimulateError, match=r"secret 'k3-api-key' does not exist \(give it with --secret"):
        _plan(cr, tmp_path, claims={})
    _, pods = _plan(cr, tmp_path, lws=True, claims={}, secrets={"k3-api-key": {"api-key": "x"}})
    assert {"k3-decode-0", "k3-decode-0-1"} <= {p.name for p in pods}  # LWS pods: tests/test_operator_lws.py
    cr = sample()
    with pytest.raises(SimulateError, match=r"PersistentVolumeClaim 'k3-tiny-model': give a local directory"):
        _plan(cr, tmp_path, claims={})
    cr["spec"]["router"]["apiKeySecretRef"] = {"name": "key", "key": "k"}
    with pytest.raises(SimulateError, match=r"secret 'key' does not exist \(give it with --secret key/KEY=VALUE\)"):
        _plan(cr, tmp_path)
    _, pods = _plan(cr, tmp_path, secrets={"key": {"k": "s3cret"}})
    router = next(p for p in pods if p.component == "router")
    assert router.files["fs/etc/k3serve/api-key/k"] == b"s3cret"
    assert router.argv[router.argv.index("--api-key-file") + 1].endswith("/fs/etc/k3serve/api-key/k")


def test_expand_and_rewrite_follow_kubernetes():
    env = {"A": "1", "B": "x"}
    assert expand("$(A)-$(B)-$(C)-$$(A)", env) == "1-x-$(C)-$(A)"
    from k3serve.operator.simulate_plan import ServiceRoute

    routes = {"s.ns.svc.cluster.local": ServiceRoute("127.1.1.1", {80: 8080}), "s.ns": ServiceRoute("127.1.1.1", {})}
    assert rewrite_hosts("http://s.ns.svc.cluster.local:80/v1", routes) == "http://127.1.1.1:8080/v1"
    assert rewrite_hosts("s.ns:5 s.ns.other", routes) == "127.1.1.1:5 s.ns.other"


# --- the pods, running ------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=sorted(SCENARIOS))
def deployment(request, tiny_model_dir):
    sim = shared_simulation(request, request.param, SCENARIOS[request.param][0], tiny_model_dir, prometheus=True)
    sim.scenario = request.param
    yield sim
    release(request, request.param)  # one layout's pods at a time


@pytest.fixture(scope="module")
def client(deployment):
    return openai.OpenAI(base_url=deployment.gateway, api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def offline(tiny_model_dir):
    import torch

    from k3serve.workers.llm import LLM

    torch.set_num_threads(1)
    return LLM(str(tiny_model_dir), max_model_len=1024)


def _offline_chat(llm, msgs, max_tokens, **kw) -> str:
    from k3serve.sampling_params import SamplingParams

    out = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=max_tokens), **kw)[0].outputs[0]
    return out.text


def test_every_rendered_pod_is_ready_and_the_gateway_is_status_gateway_url(deployment, client):
    out = deployment.output()
    pods = SCENARIOS[deployment.scenario][1]
    assert deployment.status_gateway == "http://tiny-router.default.svc.cluster.local:8000/v1"
    for pod in pods:
        assert f"pod {pod} " in out, out
    assert f"pods={len(pods)}" in out
    # the operator, reconciling the same CR against the API emulator, reports it Ready with this URL
    assert f"operator status phase=Ready readyPools={len(pods)}/{len(pods)}" in out, out
    # every pod ran what the renderer says, as a real process: the workers, the router and the master
    role = "both" if deployment.scenario == "colocated" else "decode"
    assert f"role={role} model=k3-tiny" in deployment.log("tiny-decode-0")  # K3SERVE_SERVED_MODEL_NAME
    if deployment.scenario == "pd":
        assert "role=prefill model=k3-tiny" in deployment.log("tiny-prefill-0")
    router_log = deployment.log("tiny-router-sim0")
    assert "k3serve router: listening" in router_log
    # --discovery kubernetes as rendered: the router found the workers as Pods in the API (emulator)
    assert f"127.100.0.1:50051 ({role}) added" in router_log, router_log[-2000:]
    if deployment.scenario == "pd":
        assert "127.100.0.2:50051 (prefill) added" in router_log
    assert "Master service started" in deployment.log("tiny-kvstore-sim0")
    (card,) = client.models.list().data
    assert card.id == NAME


def test_chat_greedy_equals_offline_engine(client, offline):
    kw = {"thinking": False}
    r = client.chat.completions.create(model=NAME, messages=MSGS, max_tokens=10, temperature=0,
                                       extra_body={"chat_template_kwargs": kw})
    assert r.choices[0].message.content == _offline_chat(offline, MSGS, 10, chat_template_kwargs=kw)
    assert r.usage.completion_tokens == 10


def test_stream_equals_nonstream(client):
    kw = {"extra_body": {"chat_template_kwargs": {"thinking": False}}}
    full = client.chat.completions.create(model=NAME, messages=MSGS, max_tokens=8, temperature=0, **kw)
    chunks = list(client.chat.completions.create(model=NAME, messages=MSGS, max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_tools_greedy_equals_offline_engine(client, offline):
    from k3serve.chat.renderer import render_chat

    kw = {"thinking": False}
    r = client.chat.completions.create(model=NAME, messages=MSGS, tools=[WEATHER], tool_choice="auto",
                                       max_tokens=6, temperature=0, extra_body={"chat_template_kwargs": kw})
    tok = offline.tokenizer
    assert r.usage.prompt_tokens == len(render_chat(tok, MSGS, tools=[WEATHER], tool_choice="auto",
                                                    thinking=False).token_ids)
    msg = r.choices[0].message
    offline_text = _offline_chat(offline, MSGS, 6, tools=[WEATHER], chat_template_kwargs=kw)
    if msg.tool_calls:  # the random model emitted a call: it must be the only tool it was given
        assert all(tc.function.name == "get_weather" for tc in msg.tool_calls)
    else:
        assert msg.content == offline_text


def test_completions_greedy_equals_offline_engine(client, offline):
    from k3serve.sampling_params import SamplingParams

    r = client.completions.create(model=NAME, prompt="The cache keeps", max_tokens=8, temperature=0,
                                  extra_body={"ignore_eos": True})
    ref = offline.generate("The cache keeps", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert r.choices[0].text == ref.outputs[0].text


@pytest.mark.parametrize("deployment", ["pd"], indirect=True)
def test_pd_requests_pull_their_prompt_state_from_the_prefill_pod(deployment, client):
    long = [{"role": "user", "content": "Tell me about prefill and decode. " * 8}]
    client.chat.completions.create(model=NAME, messages=long, max_tokens=2, temperature=0)
    import httpx

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        r = httpx.get(f"{deployment.prometheus}/api/v1/query",
                      params={"query": 'sum(k3serve_kv_transfer_bytes_total{k3serve_io_role="decode"})'}).json()
        result = r["data"]["result"]
        if result and float(result[0]["value"][1]) > 0:
            return
        time.sleep(0.5)
    pytest.fail(f"no KV bytes moved to the decode pod: {r}")


def test_sample_file_is_what_the_simulation_ran(deployment):
    ran = yaml.safe_load((deployment.root.parent / "cr.yaml").read_text())
    assert ran == SCENARIOS[deployment.scenario][0]()


def test_pods_fetch_an_hf_model_uri_and_serve_it(tmp_path, tiny_model_dir, offline):
    """spec.model.uri hf://ORG/NAME: every worker and router pod fetches the checkpoint through the Hub
    HTTP API (a local server imitating it, HF_ENDPOINT from spec.<pool>.env / spec.router.env; the token
    from a Secret) into its $K3SERVE_HOME, at spec.model.revision, and serves it."""
    from ._k8s_sim import start_simulation
    from ._model_sources import FakeSources

    with FakeSources.from_dir(tiny_model_dir, repo="k3serve/tiny") as hub:
        cr = colocated_cr()
        cr["spec"]["kvStore"]["enabled"] = False  # the hub listens on this machine's loopback
        cr["spec"]["model"] = {"uri": "hf://k3serve/tiny", "revision": "main", "name": NAME,
                               "architecture": cr["spec"]["model"]["architecture"]}
        env = [{"name": "HF_ENDPOINT", "value": hub.url},
               {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}]
        cr["spec"]["decode"]["env"] = env
        cr["spec"]["router"]["env"] = env
        sim = start_simulation(cr, tmp_path, model_dir=tiny_model_dir, operator=False,
                               extra_args=["--secret", "hf/token=hf_test_token"])
        try:
            client = openai.OpenAI(base_url=sim.gateway, api_key="none", max_retries=0, timeout=120)
            kw = {"thinking": False}
            r = client.chat.completions.create(model=NAME, messages=MSGS, max_tokens=6, temperature=0,
                                               extra_body={"chat_template_kwargs": kw})
            assert r.choices[0].message.content == _offline_chat(offline, MSGS, 6, chat_template_kwargs=kw)
            for pod in ("tiny-decode-0", "tiny-router-sim0"):
                assert "k3serve: fetching hf://k3serve/tiny@main" in sim.log(pod), sim.log(pod)
                home = sim.root / "pods" / pod / "fs/var/cache/k3serve/models/hf/k3serve--tiny" / hub.sha
                assert (home / ".k3serve-complete").is_file()
            api = [q for q in hub.requests if q["path"].startswith("/api/models/")]
            assert len(api) == 2 and all(q["headers"]["authorization"] == "Bearer hf_test_token" for q in api)
        finally:
            assert sim.stop() == 0, sim.output()[-3000:]


def test_the_tiny_model_job_writes_the_checkpoint_the_sample_serves(tmp_path, tiny_model_dir):
    """manifests/samples/tiny-model-pvc.yaml: strictly valid objects, the pod contract's hardening, and
    its Job's args (run here with /models in a folder) write the very checkpoint the tests serve."""
    import os
    import subprocess
    import sys

    from k3serve.operator.testing import validate

    from ._k8s_sim import ROOT

    docs = list(yaml.safe_load_all((ROOT / "manifests/samples/tiny-model-pvc.yaml").read_text()))
    for doc in docs:
        doc["metadata"]["namespace"] = "demo"
        assert validate.errors(doc) == [], doc["kind"]
    pvc, job = docs
    claim = sample()["spec"]["model"]["pvc"]
    assert pvc["metadata"]["name"] == claim["claimName"]
    pod = job["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsUser"] == 1000 and pod["securityContext"]["fsGroup"] == 1000
    (c,) = pod["containers"]
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    mount = next(m["mountPath"] for m in c["volumeMounts"] if m["name"] == "model")
    args = [a.replace(mount, str(tmp_path)) for a in c["args"]]
    assert f"{mount}{claim['path']}" in c["args"]  # it writes where tiny-cpu.yaml reads
    subprocess.run([sys.executable, "-m", "k3serve.cli", *args], check=True, capture_output=True, timeout=300,
                   env={**os.environ, "PYTHONSAFEPATH": "1", "OMP_NUM_THREADS": "1"})
    out = tmp_path / claim["path"].lstrip("/")
    for f in tiny_model_dir.iterdir():
        if f.is_file():
            assert (out / f.name).read_bytes() == f.read_bytes(), f.name


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--pvc", "k3-tiny-model"], "--pvc 'k3-tiny-model': expected CLAIM=DIR"),
        (["--pvc", "k3-tiny-model=/nonexistent/dir"], "/nonexistent/dir is not a directory"),
        (["--secret", "nokey=1"], "--secret 'nokey=1': expected NAME/KEY=VALUE"),
    ],
)
def test_simulate_bad_input_is_one_line_and_exit_2(tmp_path, extra, needle):
    import os
    import subprocess
    import sys

    from ._k8s_sim import ROOT

    cmd = [sys.executable, "-m", "k3serve.cli", "operator", "simulate", "-f",
           str(ROOT / "manifests/samples/tiny-cpu.yaml"), "--root", str(tmp_path), *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**os.environ,
                                                                              "PYTHONSAFEPATH": "1"})
    assert r.returncode == 2 and needle in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("apiVersion: k3serve.io/v1alpha1\nkind: KimiK3Deployment\nmetadata: {name: x}\nspec: {}\n")
    r = subprocess.run(cmd[:6] + [str(bad)], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONSAFEPATH": "1"})
    assert r.returncode == 2 and "the CR cannot be served" in r.stderr and "spec" in r.stderr, r.stderr
