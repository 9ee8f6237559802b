"""Serving layouts: how a (defaulted) KimiK3Deployment spec maps onto groups, nodes and GPUs, and
the rules a layout must satisfy to serve a hybrid KDA + MLA model.

A pool has `replicas` groups; a group is one model instance of world = tensorParallelSize x
dataParallelSize ranks, one GPU per rank, spread over nodes_per_group pods (one pod per node).
`problems(name, spec)` returns the user-facing reasons a spec cannot be served; the operator marks
such a deployment Degraded and creates nothing. The rules with a `cel` expression are also enforced
at admission by the CRD (x-kubernetes-validations) with the same `message`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

MAX_NAME_LENGTH = 40


@dataclass(frozen=True)
class PoolLayout:
    """One worker pool as rendered. `role` is the worker's --role (prefill | decode | both)."""

    pool: str  # "prefill" | "decode"
    role: str
    replicas: int
    tensor_parallel: int
    data_parallel: int
    expert_parallel: bool
    gpus_per_node: int
    sequence_parallel: bool = False  # --enable-sequence-parallel (workers/engine/parallel/seq_parallel.py)

    @property
    def world(self) -> int:
        return self.tensor_parallel * self.data_parallel

    @property
    def cpu_only(self) -> bool:
        return self.gpus_per_node == 0

    @property
    def nodes_per_group(self) -> int:
        if self.cpu_only:
            return 1
        return max(1, math.ceil(self.world / self.gpus_per_node))

    @property
    def gpus_per_pod(self) -> int:
        if self.cpu_only:
            return 0
        return min(self.world, self.gpus_per_node)

    @property
    def multi_node(self) -> bool:
        return self.nodes_per_group > 1


@dataclass(frozen=True)
class Plan:
    prefill: PoolLayout | None  # None when colocated (prefill.replicas == 0)
    decode: PoolLayout

    @property
    def colocated(self) -> bool:
        return self.prefill is None

    def pools(self) -> list[PoolLayout]:
        return [p for p in (self.prefill, self.decode) if p is not None]


def _pool(spec: dict, pool: str, role: str) -> PoolLayout:
    p = spec[pool]
    return PoolLayout(
        pool=pool,
        role=role,
        replicas=int(p["replicas"]),
        tensor_parallel=int(p["tensorParallelSize"]),
        data_parallel=int(p["dataParallelSize"]),
        expert_parallel=bool(p["expertParallel"]),
        gpus_per_node=int(p["gpusPerNode"]),
        sequence_parallel=bool(p.get("sequenceParallel", False)),
    )


def plan(spec: dict) -> Plan:
    """Pools of a defaulted spec. prefill.replicas == 0 means colocated: decode runs --role both."""
    if int(spec["prefill"]["replicas"]) == 0:
        return Plan(prefill=None, decode=_pool(spec, "decode", "both"))
    return Plan(prefill=_pool(spec, "prefill", "prefill"), decode=_pool(spec, "decode", "decode"))


@dataclass(frozen=True)
class Rule:
    """A serveability rule. `check(spec)` returns a detailed message or None; `cel` (optional) is the
    same rule as a CRD x-kubernetes-validations expression evaluated on `.spec` with `message`."""

    name: str
    message: str
    check: Callable[[dict], str | None]
    cel: str | None = None


def _divisors(n: int, limit: int = 64) -> str:
    return ", ".join(str(d) for d in range(1, min(n, limit) + 1) if n % d == 0)


def _heads_rule(pool: str) -> Rule:
    def check(spec: dict) -> str | None:
        tp = int(spec[pool]["tensorParallelSize"])
        arch = spec["model"]["architecture"]
        bad = [
            f"{arch[key]} {label} heads"
            for key, label in (("kdaHeads", "KDA"), ("mlaHeads", "MLA"))
            if int(arch[key]) % tp
        ]
        if not bad:
            return None
        common = math.gcd(int(arch["kdaHeads"]), int(arch["mlaHeads"]))
        return (
            f"spec.{pool}.tensorParallelSize {tp} does not divide the model's {' and '.join(bad)}; "
            f"heads are sharded evenly over tensor-parallel ranks (valid sizes: {_divisors(common)})"
        )

    cel = (
        f"self.model.architecture.kdaHeads % self.{pool}.tensorParallelSize == 0 && "
        f"self.model.architecture.mlaHeads % self.{pool}.tensorParallelSize == 0"
    )
    return Rule(
        f"{pool}-heads",
        f"spec.{pool}.tensorParallelSize must divide the model's KDA and MLA head counts",
        check,
        cel,
    )


def _world(spec: dict, pool: str) -> int:
    return int(spec[pool]["tensorParallelSize"]) * int(spec[pool]["dataParallelSize"])


def _fits_nodes_rule(pool: str) -> Rule:
    def check(spec: dict) -> str | None:
        world, gpn = _world(spec, pool), int(spec[pool]["gpusPerNode"])
        if gpn == 0:
            if world != 1:
                return (
                    f"spec.{pool}: a CPU pool (gpusPerNode 0) runs one rank per pod, but "
                    f"tensorParallelSize x dataParallelSize is {world}"
                )
            return None
        if world > gpn and world % gpn:
            return (
                f"spec.{pool}: {world} ranks per group (tensorParallelSize x dataParallelSize) do not "
                f"fill whole {gpn}-GPU nodes; use a multiple of {gpn} or at most {gpn}"
            )
        return None

    w = f"(self.{pool}.tensorParallelSize * self.{pool}.dataParallelSize)"
    cel = (
        f"self.{pool}.gpusPerNode == 0 ? {w} == 1 : "
        f"({w} <= self.{pool}.gpusPerNode || {w} % self.{pool}.gpusPerNode == 0)"
    )
    return Rule(
        f"{pool}-fits-nodes",
        f"spec.{pool}: a group's ranks must fit whole nodes (a multiple of "
        f"gpusPerNode, at most gpusPerNode, or exactly 1 rank on CPU)",
        check,
        cel,
    )


def _experts_rule(pool: str) -> Rule:
    def check(spec: dict) -> str | None:
        world, experts = _world(spec, pool), int(spec["model"]["architecture"]["numExperts"])
        if spec[pool]["expertParallel"] and experts % world:
            return (
                f"spec.{pool}: expertParallel over {world} ranks needs numExperts divisible by {world}, "
                f"but the model has {experts} experts"
            )
        return None

    cel = (
        f"!self.{pool}.expertParallel || self.model.architecture.numExperts % "
        f"(self.{pool}.tensorParallelSize * self.{pool}.dataParallelSize) == 0"
    )
    return Rule(
        f"{pool}-experts",
        f"spec.{pool}: with expertParallel, the group's rank count must divide numExperts",
        check,
        cel,
    )


def _sequence_parallel_rule(pool: str) -> Rule:
    """Sequence parallelism shards the tokens over the tensor-parallel ranks and moves them to their
    experts by all-to-all (workers/engine/parallel/shard.py check_layout says the same to the worker)."""

    def check(spec: dict) -> str | None:
        p = spec[pool]
        if not p.get("sequenceParallel"):
            return None
        why = []
        if not p["expertParallel"]:
            why.append("expertParallel is false (the MoE all-to-all moves each token shard to whole experts)")
        if int(p["tensorParallelSize"]) < 2:
            why.append(f"tensorParallelSize is {p['tensorParallelSize']} (there are no ranks to shard the "
                       "tokens over)")
        if why:
            return f"spec.{pool}.sequenceParallel needs expertParallel and tensorParallelSize > 1, but " + (
                " and ".join(why))
        return None

    cel = (
        f"!has(self.{pool}.sequenceParallel) || !self.{pool}.sequenceParallel || "
        f"(self.{pool}.expertParallel && self.{pool}.tensorParallelSize > 1)"
    )
    return Rule(
        f"{pool}-sequence-parallel",
        f"spec.{pool}.sequenceParallel needs expertParallel and tensorParallelSize > 1",
        check,
        cel,
    )


def _pd_rule() -> Rule:
    def check(spec: dict) -> str | None:
        if int(spec["prefill"]["replicas"]) == 0:
            return None
        p, d = int(spec["prefill"]["tensorParallelSize"]), int(spec["decode"]["tensorParallelSize"])
        if max(p, d) % min(p, d):
            return (
                f"prefill tensorParallelSize {p} and decode tensorParallelSize {d} do not divide one "
                f"another: KDA recurrent state moves from prefill to decode sliced by heads, so one "
                f"side's head shards must be whole multiples of the other's"
            )
        return None

    cel = (
        "self.prefill.replicas == 0 || self.prefill.tensorParallelSize % self.decode.tensorParallelSize == 0"
        " || self.decode.tensorParallelSize % self.prefill.tensorParallelSize == 0"
    )
    return Rule(
        "pd-tensor-parallel",
        "spec.prefill.tensorParallelSize and spec.decode.tensorParallelSize "
        "must divide one another (KDA state is transferred sliced by heads)",
        check,
        cel,
    )


def _model_source_rule() -> Rule:
    def check(spec: dict) -> str | None:
        has_uri, has_pvc = bool(spec["model"].get("uri")), bool(spec["model"].get("pvc"))
        if has_uri == has_pvc:
            return "spec.model: set exactly one of uri or pvc" + (" (both are set)" if has_uri else "")
        return None

    return Rule(
        "model-source",
        "spec.model: set exactly one of uri or pvc",
        check,
        "has(self.model.uri) != has(self.model.pvc)",
    )


def _engine_rule() -> Rule:
    def check(spec: dict) -> str | None:
        if spec.get("engine", "native") != "native":
            return (
                f"spec.engine {spec['engine']!r} is reserved for a later release; this operator renders "
                f"engine 'native' only"
            )
        return None

    return Rule("engine", "spec.engine: only native is rendered", check)


def _cache_rule() -> Rule:
    def check(spec: dict) -> str | None:
        cache = spec["cache"]
        block, unit, interval = (
            cache.get("blockSize"),
            cache.get("prefixMatchUnit"),
            cache["retentionInterval"],
        )
        if block and unit and int(block) % int(unit):
            return f"spec.cache.prefixMatchUnit {unit} must divide spec.cache.blockSize {block}"
        if block and str(interval) not in ("0", "dense") and int(interval) % int(block):
            return (
                f"spec.cache.retentionInterval {interval} must be a multiple of spec.cache.blockSize "
                f"{block} (states are kept at block boundaries)"
            )
        return None

    return Rule(
        "cache",
        "spec.cache: prefixMatchUnit must divide blockSize and retentionInterval must be a multiple of it",
        check,
    )


def _offload_rule() -> Rule:
    def check(spec: dict) -> str | None:
        cache = spec["cache"]
        if cache.get("offloadMemory") and not cache["prefixCaching"]:
            return (f"spec.cache.offloadMemory ({cache['offloadMemory']}) needs spec.cache.prefixCaching: "
                    "the host tier holds cached prefixes")
        return None

    return Rule(
        "cache-offload",
        "spec.cache.offloadMemory needs spec.cache.prefixCaching",
        check,
        "!has(self.cache) || !has(self.cache.offloadMemory) || !has(self.cache.prefixCaching) "
        "|| self.cache.prefixCaching",
    )


def _env_rule() -> Rule:
    """The env entries' CEL rule (operator/schema_dsl.py env_list), checked again here."""

    def check(spec: dict) -> str | None:
        for where in ("prefill", "decode", "router"):
            for e in (spec.get(where) or {}).get("env") or []:
                if "value" in e and "valueFrom" in e:
                    return f"spec.{where}.env {e.get('name')}: set value or valueFrom, not both"
        return None

    return Rule("env", "spec.*.env: set value or valueFrom, not both", check)


def _only_with_prefill(rule: Rule) -> Rule:
    """Prefill rules do not apply when the pool has no replicas (colocated mode)."""
    if not rule.name.startswith("prefill-") or not rule.cel:
        return rule
    return Rule(rule.name, rule.message, rule.check, f"self.prefill.replicas == 0 || ({rule.cel})")


RULES: tuple[Rule, ...] = tuple(
    _only_with_prefill(r)
    for r in (
        _model_source_rule(),
        _engine_rule(),
        _heads_rule("prefill"),
        _heads_rule("decode"),
        _fits_nodes_rule("prefill"),
        _fits_nodes_rule("decode"),
        _experts_rule("prefill"),
        _experts_rule("decode"),
        _sequence_parallel_rule("prefill"),
        _sequence_parallel_rule("decode"),
        _pd_rule(),
        _cache_rule(),
        _offload_rule(),
        _env_rule(),
    )
)


def problems(name: str, spec: dict) -> list[str]:
    """Every reason the (defaulted) spec cannot be served, as user-facing messages; [] if servable.
    Rules about the prefill pool are skipped when it has no replicas (colocated)."""
    out: list[str] = []
    if len(name) > MAX_NAME_LENGTH:
        out.append(
            f"metadata.name is {len(name)} characters; at most {MAX_NAME_LENGTH} leave room for the "
            f"suffixes of the objects the operator creates"
        )
    colocated = int(spec["prefill"]["replicas"]) == 0
    for rule in RULES:
        if colocated and rule.name.startswith("prefill-"):
            continue
        msg = rule.check(spec)
        if msg:
            out.append(msg)
    from k3serve.operator.validation import pd_geometry_problems  # the workers' own P/D mapping check

    out += [p for p in pd_geometry_problems(spec) if p not in out]
    return out
