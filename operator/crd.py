"""The KimiK3Deployment CRD (k3serve.io/v1alpha1): the single definition of its schema.

`crd()` returns the CustomResourceDefinition object; the chart (`charts/k3serve/crds/`) and
`manifests/crd/` hold exactly its YAML (`k3serve operator generate` writes them, a test compares).
The schema's defaults are K3's production layout: TEP8 prefill (tensor-parallel 8 + expert-parallel)
and DEP16 decode (data-parallel 16 + expert-parallel, 8 GPUs per node, so two nodes per group).

Cross-field rules that decide whether a layout can serve the model live in `layout.RULES`; each
carries a CEL expression that the API server checks at admission (x-kubernetes-validations) and a
Python predicate that the operator checks again before creating anything (Degraded otherwise).
"""

from __future__ import annotations

import copy

from k3serve.operator import layout
from k3serve.operator.schema_dsl import (
    array,
    boolean,
    env_list,
    int_or_string,
    integer,
    obj,
    quantity,
    resource_requirements,
    string,
    string_map,
    tolerations,
)

GROUP = "k3serve.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "KimiK3Deployment"
PLURAL = "kimik3deployments"
SINGULAR = "kimik3deployment"
SHORT_NAMES = ["k3dep"]
CRD_NAME = f"{PLURAL}.{GROUP}"

ROUTER_POLICIES = ["hybrid-prefix", "prefix", "least-loaded", "round-robin", "random"]
ENGINES = ["native", "vllm"]
CONDITION_TYPES = ["Ready", "Progressing", "Degraded"]
PHASES = ["Pending", "Progressing", "Ready", "Degraded"]
NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"


def _pool(role: str, *, tp: int, dp: int, gpus_per_node: int, replicas: int) -> dict:
    """One worker pool; prefill and decode share field names and differ only in defaults."""
    world = tp * dp
    return obj(
        f"The {role} pool: `replicas` groups, each one model instance of tensorParallelSize x "
        f"dataParallelSize ranks (one GPU each) spread over ceil(ranks / gpusPerNode) nodes. "
        f"Default: {world} ranks, {gpus_per_node} GPUs per node.",
        {
            "replicas": integer(
                f"Number of {role} groups (model instances). "
                + (
                    "0 runs colocated: the decode pool serves whole requests (--role both)."
                    if role == "prefill"
                    else "Scalable through the scale subresource."
                ),
                default=replicas,
                minimum=0,
                maximum=1024,
            ),
            "tensorParallelSize": integer(
                "Attention tensor-parallel ranks per data-parallel rank; must "
                "divide the model's KDA and MLA head counts.",
                default=tp,
                minimum=1,
                maximum=64,
            ),
            "dataParallelSize": integer(
                "Data-parallel attention ranks per group.", default=dp, minimum=1, maximum=256
            ),
            "expertParallel": boolean(
                "Shard the MoE experts over all ranks of the group (EP size = "
                "tensorParallelSize x dataParallelSize).",
                default=True,
            ),
            "sequenceParallel": boolean(
                "TEP with sequence parallelism (--enable-sequence-parallel): between attention layers each "
                "tensor-parallel rank keeps a shard of the tokens (reduce-scatter after o_proj, MoE "
                "all-to-all, all-gather before the next QKV). Needs expertParallel and "
                "tensorParallelSize > 1.",
                default=False,
            ),
            "gpusPerNode": integer(
                "GPUs each node gives this pool; 0 runs on CPUs (one rank per pod).",
                default=gpus_per_node,
                minimum=0,
                maximum=16,
            ),
            "resources": resource_requirements(
                "Resources of each worker pod. The operator adds nvidia.com/gpu itself."
            ),
            "nodeSelector": string_map("Node labels each worker pod requires."),
            "tolerations": tolerations("Tolerations of each worker pod."),
            "env": env_list("Extra environment variables for the worker container."),
            "shmSize": quantity("Size of the in-memory /dev/shm of each worker pod.", default="16Gi"),
            "transferDevices": string(
                "UCX network devices for the P/D KV transfers of this pool (--kv-transfer-devices, "
                "UCX_NET_DEVICES form, e.g. mlx5_0:1,mlx5_1:1); unset: same-host shared memory only.",
                pattern=r"^[A-Za-z0-9_.:-]+(,[A-Za-z0-9_.:-]+)*$",
                max_length=1024,
            ),
        },
        default={},
    )


def spec_schema() -> dict:
    architecture = obj(
        "Head and expert counts the layout checks need. Defaults are Kimi K3's.",
        {
            "kdaHeads": integer("KDA (linear attention) heads.", default=96, minimum=1),
            "mlaHeads": integer("MLA (full attention) heads.", default=96, minimum=1),
            "numExperts": integer("Routed MoE experts.", default=896, minimum=1),
        },
        default={},
    )
    model = obj(
        "Which checkpoint to serve: a URI (hf://org/name, s3://, gs://, https://) or a path on a "
        "PersistentVolumeClaim, exactly one of the two.",
        {
            "uri": string(
                "Checkpoint URI; the worker downloads it into its cache volume.",
                pattern=r"^(hf|s3|gs|https?)://[^\s]+$",
            ),
            "pvc": obj(
                "A checkpoint directory on a PersistentVolumeClaim, mounted read-only at /models.",
                {
                    "claimName": string("PersistentVolumeClaim name.", pattern=NAME_PATTERN, max_length=253),
                    "path": string("Directory inside the claim.", default="/", pattern=r"^/[^\s]*$"),
                },
                required=["claimName"],
            ),
            "revision": string("Checkpoint revision (branch, tag or commit) for hf:// URIs.", default="main"),
            "name": string(
                "Model name served by the OpenAI API.",
                default="kimi-k3",
                pattern=r"^[A-Za-z0-9][-A-Za-z0-9._/]*$",
                max_length=128,
            ),
            "architecture": architecture,
        },
    )
    router = obj(
        "The OpenAI-compatible gateway.",
        {
            "replicas": integer("Router replicas.", default=2, minimum=1, maximum=64),
            "serviceType": string(
                "Type of the gateway Service.",
                default="ClusterIP",
                enum=["ClusterIP", "NodePort", "LoadBalancer"],
            ),
            "port": integer("Port of the gateway Service.", default=8000, minimum=1, maximum=65535),
            "policy": string(
                "Routing policy: hybrid-prefix scores usable hybrid cache hits (min of the MLA hit "
                "and the deepest KDA snapshot) against load.",
                default="hybrid-prefix",
                enum=ROUTER_POLICIES,
            ),
            "apiKeySecretRef": obj(
                "Secret holding the API key clients must send as a bearer token.",
                {
                    "name": string("Secret name.", pattern=NAME_PATTERN, max_length=253),
                    "key": string("Key inside the Secret.", default="api-key", pattern=r"^[-._a-zA-Z0-9]+$"),
                },
                required=["name"],
            ),
            "resources": resource_requirements("Resources of each router pod."),
            "env": env_list(
                "Extra environment variables for the router container (with spec.model.uri the router "
                "fetches the tokenizer and config too: HF_TOKEN, HF_ENDPOINT, AWS_*, ...)."
            ),
        },
        default={},
    )
    kv_store = obj(
        "The Mooncake store shared by all workers (prefix cache beyond one worker).",
        {
            "enabled": boolean("Run the Mooncake master and connect the workers to it.", default=True),
            "memory": quantity(
                "Host memory each worker pod contributes to the store (its global segment).", default="16Gi"
            ),
            "deadlineMs": integer(
                "Longest wait on the store per lookup and per load, in milliseconds (--kv-store-deadline-ms); "
                "past it the request recomputes. Unset: the worker's default.",
                minimum=1,
                maximum=60000,
            ),
        },
        default={},
    )
    cache = obj(
        "Prefix cache of the workers (maps to the worker's cache flags).",
        {
            "prefixCaching": boolean("Reuse computed prefixes (--enable-prefix-caching).", default=True),
            "prefixMatchUnit": integer("Tokens per prefix hash unit (--prefix-match-unit).", minimum=1),
            "retentionInterval": int_or_string(
                "Which KDA states the cache keeps (--prefix-cache-retention-interval): 0 = only reachable "
                "boundaries, N = also one every N tokens, dense = every block.",
                default=0,
                pattern=r"^(dense|0|[1-9][0-9]*)$",
                minimum=0,
            ),
            "selectiveRetention": boolean(
                "Keep a shared prefix's state on its second hit (--prefix-cache-selective-retention).",
                default=False,
            ),
            "eviction": string(
                "Eviction policy (--prefix-cache-eviction).", default="lru", enum=["lru", "compute-per-byte"]
            ),
            "blockSize": integer(
                "Tokens per KV block (--block-size); unset lets the engine derive it.",
                minimum=16,
                maximum=65536,
            ),
            "kvCacheMemory": string(
                "KV cache size (--kv-cache-memory): a fraction of free accelerator "
                "memory (0.9) or a size (64Gi, 68719476736).",
                default="0.9",
                pattern=r"^((0?\.[0-9]*[1-9][0-9]*)|(1(\.0*)?)|([1-9][0-9]*([KMGT]i)?))$",
            ),
            "maxModelLen": integer("Longest context served (--max-model-len).", minimum=16),
            "offloadMemory": string(
                "Host-memory KV tier per worker pod (--kv-offload-memory): cached pages evicted from "
                "the accelerator are kept in this much host memory (64Gi, 68719476736); needs "
                "prefixCaching. Count it in the pod's memory limit. Unset: off.",
                pattern=r"^[1-9][0-9]*([KMGT]i)?$",
            ),
        },
        default={},
    )
    monitoring = obj(
        "Observability of the rendered pods.",
        {
            "podMonitor": boolean(
                "Render a PodMonitor (Prometheus operator) scraping every pod.", default=True
            ),
            "dashboards": boolean(
                "Render the Grafana dashboards as ConfigMaps in this namespace "
                "(for a Grafana sidecar; the chart ships them cluster-wide too).",
                default=False,
            ),
            "interval": string("Scrape interval.", default="15s", pattern=r"^[0-9]+(ms|s|m)$"),
        },
        default={},
    )
    return obj(
        "Desired state of a Kimi K3 deployment.",
        {
            "model": model,
            "engine": string(
                "Serving engine. Only native is rendered today; vllm is reserved.",
                default="native",
                enum=ENGINES,
            ),
            "image": string(
                "Container image of every component (entrypoint: the k3serve console script). "
                "Default: the operator's --default-image.",
                max_length=512,
            ),
            "imagePullPolicy": string(
                "Image pull policy.", default="IfNotPresent", enum=["Always", "IfNotPresent", "Never"]
            ),
            "imagePullSecrets": array(
                "Names of image pull Secrets.", string("Secret name.", pattern=NAME_PATTERN)
            ),
            "prefill": _pool("prefill", tp=8, dp=1, gpus_per_node=8, replicas=1),
            "decode": _pool("decode", tp=1, dp=16, gpus_per_node=8, replicas=1),
            "router": router,
            "kvStore": kv_store,
            "cache": cache,
            "monitoring": monitoring,
        },
        required=["model"],
        validations=[{"rule": rule.cel, "message": rule.message} for rule in layout.RULES if rule.cel],
    )


def _condition() -> dict:
    return obj(
        "A condition (Ready, Progressing or Degraded).",
        {
            "type": string("Condition type.", enum=CONDITION_TYPES),
            "status": string("True, False or Unknown.", enum=["True", "False", "Unknown"]),
            "reason": string("CamelCase reason."),
            "message": string("Human-readable details."),
            "lastTransitionTime": string("When the status last changed.", pattern=r"^\d{4}-\d\d-\d\dT"),
            "observedGeneration": integer("Generation the condition was computed for.", minimum=0),
        },
        required=["type", "status"],
    )


def _pool_status(description: str, with_selector: bool = False) -> dict:
    props = {
        "replicas": integer("Groups (model instances) desired.", minimum=0),
        "readyReplicas": integer("Groups with every pod ready.", minimum=0),
    }
    if with_selector:
        props["selector"] = string("Label selector of the group leader pods (scale subresource).")
    return obj(description, props)


def status_schema() -> dict:
    return obj(
        "Observed state, written by the operator.",
        {
            "observedGeneration": integer("Generation of the spec last reconciled.", minimum=0),
            "phase": string("Summary: Pending, Progressing, Ready or Degraded.", enum=PHASES),
            "conditions": array(
                "Ready, Progressing and Degraded.", _condition(), list_type="map", map_keys=["type"]
            ),
            "prefill": _pool_status("Prefill pool."),
            "decode": _pool_status("Decode pool.", with_selector=True),
            "router": _pool_status("Router."),
            "kvStore": _pool_status("Mooncake master."),
            "readyPools": string("Ready pools / pools, e.g. 4/4."),
            "gatewayURL": string("OpenAI-compatible base URL of the gateway."),
            "configHash": string("Hash of the rendered configuration."),
        },
    )


def crd() -> dict:
    """The CustomResourceDefinition object (apiextensions.k8s.io/v1)."""
    schema = obj(
        "A Kimi K3 serving deployment: prefill and decode pools, router, Mooncake store.",
        {
            "apiVersion": string("API version."),
            "kind": string("Kind."),
            "metadata": {"type": "object"},
            "spec": spec_schema(),
            "status": status_schema(),
        },
        required=["spec"],
        validations=[
            {
                "rule": f"size(self.metadata.name) <= {layout.MAX_NAME_LENGTH}",
                "message": f"metadata.name must be at most {layout.MAX_NAME_LENGTH} characters "
                "(child objects add suffixes)",
            }
        ],
    )
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": CRD_NAME,
            "labels": {"app.kubernetes.io/name": "k3serve", "app.kubernetes.io/part-of": "k3serve"},
        },
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "plural": PLURAL,
                "singular": SINGULAR,
                "kind": KIND,
                "listKind": KIND + "List",
                "shortNames": SHORT_NAMES,
                "categories": ["k3serve"],
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": schema},
                    "subresources": {
                        "status": {},
                        "scale": {
                            "specReplicasPath": ".spec.decode.replicas",
                            "statusReplicasPath": ".status.decode.replicas",
                            "labelSelectorPath": ".status.decode.selector",
                        },
                    },
                    "additionalPrinterColumns": [
                        {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
                        {
                            "name": "Ready",
                            "type": "string",
                            "jsonPath": ".status.readyPools",
                            "description": "Ready pools / pools",
                        },
                        {"name": "Gateway", "type": "string", "jsonPath": ".status.gatewayURL"},
                        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
                    ],
                }
            ],
        },
    }


def openapi_schema() -> dict:
    """The version's openAPIV3Schema (a fresh copy)."""
    return copy.deepcopy(crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"])
