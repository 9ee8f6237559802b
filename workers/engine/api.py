"""The engine's public contract, used by the offline `LLM`, `k3serve serve` and the gRPC worker.

    engine = LLMEngine.from_args(EngineArgs(model=DIR, ...))
    engine.add_request(request_id, prompt_token_ids, SamplingParams(...), cache_salt=None)
    while engine.has_unfinished_requests():
        for out in engine.step():          # list[RequestOutput]; only requests that changed
            ...                            # out.outputs[i].token_ids / .text are cumulative
    engine.abort_request([request_id])     # finish_reason "abort", freed at once

Thread-safety: LLMEngine is single-threaded. AsyncEngine (workers/async_engine.py) runs it on one
background thread and hands add/abort calls over through a queue.

`RequestOutput.outputs[i]` is cumulative (all tokens so far); streaming layers compute deltas.
With n > 1 a request fans out into n sequences that share the prompt; outputs carry all n.

EngineArgs is the one configuration source: `k3serve serve` and `k3serve worker` generate their
engine flags from its fields (workers/engine_cli.py `add_engine_args` / `engine_args_from`), so a field
declared here is settable from the command line with no other edit.

How to add a field (its flag appears in `serve` and `worker` by itself):

    my_budget: int | None = arg(None, "what it does, as `--help` shows it", parse=parse_size)

* `arg(default, help, ...)` is `dataclasses.field` with the CLI description in its metadata. The flag is
  the field name with `-` for `_` (`--my-budget`); pass `flag="--other-spelling"` only to keep a spelling
  fixed elsewhere (the pod contract in docs/components.md names the worker's flags), `aliases=` to keep a
  renamed flag's old spelling parsing.
* The value parser: `parse=` a function str -> value that raises ValueError with a readable message
  (argparse prints it as `argument --my-budget: <message>`, exit 2). Without `parse=` it follows the
  default's type (int, float, str). A bool field with default False is a switch (`--my-switch`); with
  default None (annotated `bool | None`) it is `--my-switch/--no-my-switch` (None = the engine decides);
  any other field with default None and no `parse=` takes a string. `choices=` restricts
  the values (and is shown in `--help`). Sizes use `parse_size` (k3serve/common/sizes.py: 8G, 8GiB,
  512M, plain bytes) so every size flag reads the same way; `positive_int`, `kv_memory` and
  `retention_interval` below are examples. tests/test_engine_args_cli.py sets every field from the
  command line with a sample string; if your parser accepts none of its CANDIDATES, add one there. Checks that need several fields or the model (a unit dividing the block size, a budget too
  small for a request) belong in the engine, which raises ValueError (`k3serve: error: ...`, exit 1).
* `nargs="+"` with `to_field=` (a function from the parsed list to the field's value) for a flag that
  takes several words; `cli=False` keeps a field off the command line (only `model`, which every
  command spells its own way; tests/test_engine_args_cli.py fails for a field that is neither).
* Flags that are not engine fields (`--num-threads`, `--log-level`, each command's own flags) are
  listed in workers/engine_cli.py `HAND_WRITTEN`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field
from typing import Any

from k3serve.common.sizes import parse_size
from k3serve.workers.engine.spec.config import parse_speculative_config

CLI = "k3serve.cli"  # the metadata key arg() stores its Flag under


@dataclass(frozen=True)
class Flag:
    """How an EngineArgs field appears on the command line (see the module docstring)."""

    help: str
    parse: Callable[[str], Any] | None = None
    choices: tuple[str, ...] | None = None
    flag: str | None = None
    nargs: str | None = None
    to_field: Callable[[Any], Any] | None = None
    metavar: str | None = None
    aliases: tuple[str, ...] = ()  # other spellings argparse also accepts (a renamed flag's old one)


def arg(default: Any, help: str, *, parse: Callable[[str], Any] | None = None, choices=None, flag: str | None = None,
        nargs: str | None = None, to_field: Callable[[Any], Any] | None = None, metavar: str | None = None,
        cli: bool = True, aliases: tuple[str, ...] = ()):
    """A dataclass field whose metadata says how its flag is generated (cli=False: not a flag).
    `default=MISSING` makes the field required."""
    meta = ({CLI: Flag(help, parse, tuple(choices) if choices else None, flag, nargs, to_field, metavar,
                       tuple(aliases))} if cli else {})
    return field(default=default, metadata=meta)


def _non_negative_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise ValueError(f"expected a whole number >= 0, got {text!r}") from None
    if n < 0:
        raise ValueError(f"expected a whole number >= 0, got {n}")
    return n


def _port(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise ValueError(f"expected a port number, got {text!r}") from None
    if not 1 <= n <= 65535:
        raise ValueError(f"expected a port in 1..65535, got {n}")
    return n


LARGE_GPU_BYTES = 80 * 10**9
"""CUDA devices with at least this much memory get the larger default token budget per step."""


def default_max_num_batched_tokens(device_type: str, total_memory: int | None) -> int:
    """The token budget per engine step when none is given, from the device kind and its memory (bytes; None:
    unknown): 16384 on a CUDA device with >= 80 GB, so an 8K-token prefill completes in one step (vLLM raised
    its default on high-memory GPUs the same way), else 2048."""
    if device_type == "cuda" and total_memory is not None and total_memory >= LARGE_GPU_BYTES:
        return 16384
    return 2048


def device_memory(device: str) -> tuple[str, int | None]:
    """(device kind, total memory in bytes or None) of a torch device string; None where it is not a visible
    CUDA device (CPU, no CUDA here, or a malformed name: the engine reports that one when it builds)."""
    kind = device.split(":", 1)[0].strip()
    if kind != "cuda":
        return kind, None
    import torch

    try:
        if not torch.cuda.is_available():
            return kind, None
        return kind, int(torch.cuda.get_device_properties(torch.device(device)).total_memory)
    except (RuntimeError, ValueError, AssertionError):
        return kind, None


def positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise ValueError(f"not an integer: {text!r}") from None
    if n <= 0:
        raise ValueError(f"must be a positive integer, got {text!r}")
    return n


def kv_memory(text: str) -> int | float:
    """Bytes (a size: 256M, 8GiB, plain bytes) or, written with a point and no unit, a fraction in (0, 1]."""
    t = text.strip()
    if "." in t and t.replace(".", "", 1).isdigit():
        v = float(t)
        if not 0 < v <= 1:
            raise ValueError(f"a fraction of free memory must be in (0, 1], got {text!r}")
        return v
    try:
        return parse_size(t)
    except ValueError as e:
        raise ValueError(f"{e} (or a fraction such as 0.9)") from None


def retention_interval(text: str) -> int | str:
    if text == "dense":
        return text
    try:
        n = int(text)
    except ValueError:
        raise ValueError(f"not a retention interval: {text!r} (0, N or 'dense')") from None
    if n < 0:
        raise ValueError("retention interval must be >= 0")
    return n


def _devices(text: str) -> str:
    if not text.strip():
        raise ValueError("must name at least one device (e.g. mlx5_0:1)")
    return text.strip()


def _positive_seconds(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise ValueError(f"not a number of seconds: {text!r}") from None
    if not v > 0 or v == float("inf"):
        raise ValueError(f"must be a positive number of seconds, got {text!r}")
    return v


def host_port(text: str) -> str:
    """HOST:PORT (a name, an IPv4 address or a bracketed IPv6 address, and a port 1-65535)."""
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected HOST:PORT, got {text!r}")
    return text.strip()


def _first(names: list[str] | None) -> str | None:
    return names[0] if names else None


@dataclass
class EngineArgs:
    def __post_init__(self) -> None:
        self.model = os.path.expanduser(str(self.model))  # `~/...` works from Python as in a shell
        if self.max_num_batched_tokens is None:  # the field stays the one source: an int from here on
            self.max_num_batched_tokens = default_max_num_batched_tokens(*device_memory(str(self.device)))

    model: str = arg(MISSING, "checkpoint directory", cli=False)  # each command spells it its own way
    max_model_len: int | None = arg(
        None, "context length, prompt + output (default: the model's max_position_embeddings, capped at 8192)",
        parse=positive_int)
    max_num_batched_tokens: int | None = arg(
        None, "tokens per engine step (prefill chunks + decodes); default: 16384 on a CUDA device with >= 80 GB, "
        "else 2048 (resolved once, when the arguments are made)", parse=positive_int)
    max_num_seqs: int = arg(64, "requests running at once", parse=positive_int)
    block_size: int | None = arg(None, "tokens per cache page (default: derived from the KDA state page size)",
                                 parse=positive_int)
    kv_cache_memory: int | float | None = arg(
        None, "KV cache budget: bytes (256M, 8GiB) on CPU, or a fraction of free memory on CUDA (0.9)",
        parse=kv_memory, metavar="SIZE|FRACTION")
    enable_prefix_caching: bool = arg(False, "reuse cached prefixes (MLA pages and KDA snapshots)")
    prefix_match_unit: int | None = arg(None, "tokens per prefix-hash unit (must divide the block size)",
                                        parse=positive_int)
    prefix_cache_retention_interval: int | str = arg(
        0, "KDA snapshot retention: 0 (boundaries only), N tokens, or 'dense'", parse=retention_interval)
    prefix_cache_selective_retention: bool = arg(False, "keep KDA snapshots only on a second hit (Marconi-style)")
    prefix_cache_eviction: str = arg("lru", "which cached block is evicted first", choices=("lru", "compute-per-byte"))
    device: str = arg("cpu", "torch device (cpu, cuda, cuda:1)")
    dtype: str = arg("auto", "weights and activations (auto: bfloat16 on CUDA, float32 on CPU)",
                     choices=("auto", "float32", "float64", "bfloat16"))
    seed: int = arg(0, "random seed of the sampler (per-request seeds override it)")
    served_model_name: str | None = arg(
        None, "name(s) clients use in `model` (default: the model directory's name); the first is the engine's",
        nargs="+", to_field=_first)
    skip_tokenizer_init: bool = arg(False, "serve token ids only (no detokenization, no stop strings)")
    enforce_eager: bool = arg(False, "never replay decode steps from captured CUDA graphs")
    cuda_graph_max_batch: int = arg(256, "largest decode batch that gets a captured CUDA graph", parse=positive_int)
    static_decode: bool | None = arg(None, "fixed-shape padded decode steps (default: on CUDA only)")
    kv_offload_memory: int | None = arg(
        None, "host-memory KV tier: cached pages the device pool evicts are copied to this much host memory "
        "(8G, 8GiB, 512M, bytes; off by default; needs --enable-prefix-caching)", parse=parse_size,
        metavar="SIZE")
    kv_connectors: tuple[str, ...] = arg(
        (), "KV connectors after the host tier, in order (names from workers/engine/kv_connector/factory.py)",
        nargs="+", to_field=tuple, metavar="NAME")
    # Mooncake store tier (k3serve/kvstore/, docs/kvstore.md): the tier after the host tier
    kv_store: str | None = arg(
        None, "Mooncake master HOST:PORT: share prefix-cache entries (MLA pages + KDA snapshots) with every "
        "worker of the same geometry through the store (needs --enable-prefix-caching)", flag="--kv-store",
        parse=host_port, metavar="HOST:PORT")
    kv_store_deadline_ms: int = arg(
        50, "longest wait on the store per lookup and per load (ms); past it the request recomputes",
        parse=positive_int)
    kv_store_segment_bytes: int | None = arg(
        None, "memory this worker contributes to the store (default: $K3SERVE_KV_STORE_SEGMENT_BYTES, else 256M)",
        parse=parse_size, metavar="SIZE")
    kv_store_staging_bytes: int = arg(
        64 << 20, "registered staging memory for store loads and for saves, each (a larger hit is not loaded)",
        parse=parse_size, metavar="SIZE")
    # P/D transfers (workers/kv_transfer/, docs/serving.md "P/D"): used by `worker --role prefill|decode`
    kv_transfer_devices: str | None = arg(
        None, "UCX network devices for P/D KV transfers (UCX_NET_DEVICES, e.g. mlx5_0:1,eth0); unset: same-host "
        "shared memory only (UCX_TLS=self,sm, no sockets)", parse=_devices,
        metavar="DEVICES")
    kv_transfer_expiry: float = arg(
        120.0, "seconds a prefill worker keeps a finished request's pages pinned for the decode side's pull",
        parse=_positive_seconds)
    kv_transfer_timeout: float = arg(
        10.0, "seconds a decode worker waits for one pull before it recomputes the prompt itself",
        parse=_positive_seconds)
    # Multi-rank engines (workers/engine/parallel/): CPU ranks over gloo, one process per rank
    tensor_parallel_size: int = arg(
        1, "tensor-parallel ranks (one process each; divides the KDA and MLA head counts)", parse=positive_int)
    data_parallel_size: int = arg(
        1, "attention data-parallel ranks (DEP: each its own requests and caches, one process each; needs "
        "--enable-expert-parallel and tensor_parallel_size 1)", parse=positive_int)
    enable_expert_parallel: bool = arg(
        False, "shard the routed experts over the ranks (whole experts) instead of slicing each one",
        aliases=("--expert-parallel",))  # vLLM's spelling; the pod contract's former one still parses
    enable_sequence_parallel: bool = arg(
        False, "with tensor_parallel_size > 1 and expert parallelism: shard the tokens between attention layers "
        "(reduce-scatter after o_proj, MoE all-to-all, all-gather before QKV); one rank: no effect")
    # Rank groups spanning nodes and the launcher (workers/engine/parallel/nodes.py, ray_launcher.py; vLLM's names)
    nnodes: int = arg(1, "nodes (pods) the tensor- or data-parallel ranks are spread over, the same number on each",
                      parse=positive_int)
    node_rank: int = arg(0, "this node's place in the group: 0 runs the engine and hosts the rendezvous, "
                         "others run ranks only", parse=_non_negative_int)
    master_addr: str = arg("127.0.0.1", "the group leader's address (node 0): its rendezvous binds the address "
                           "this resolves to", metavar="HOST")
    master_port: int = arg(29500, "the group leader's rendezvous port (a TCPStore)", parse=_port)
    distributed_executor_backend: str = arg(
        "mp", "how the ranks are started: mp = one spawned process per rank; ray = one Ray actor per rank in a "
        "placement group (local Ray: loopback only)", choices=("mp", "ray"))
    # Speculative decoding (workers/engine/spec/, docs/serving.md "Speculative decoding")
    speculative_config: dict | None = arg(
        None, "speculative decoding, a JSON object in vLLM's shape: {\"method\": \"mtp\"|\"ngram\", "
        "\"num_speculative_tokens\": K, \"prompt_lookup_min\": N, \"prompt_lookup_max\": N, "
        "\"rollback\": \"multi_slot\"|\"recover_ssm\"}", parse=parse_speculative_config, metavar="JSON")
