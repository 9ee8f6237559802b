"""The worker's gRPC service (worker.proto) over an AsyncEngine, on grpc.aio.

    server = await start_grpc_server(async_engine, host="127.0.0.1", port=0, role="both", model_name="k3")
    server.port                      # the bound port
    server.service.kv_events         # the KvEventHub behind SubscribeKvEvents
    await server.stop(grace=2.0)

Generate streams one GenerateResponse per engine output that changed (deltas; see worker.proto for
the status codes). A cancelled call aborts the request in the engine.

SubscribeKvEvents streams the snapshot, then live batches, from a `KvEventHub` (workers/kv_events.py);
a subscriber whose queue overflows (`max_queued_batches`) is ended with RESOURCE_EXHAUSTED, an engine
that stops ends the stream with UNAVAILABLE; a cancelled call unsubscribes.
"""

from __future__ import annotations

import logging

import grpc

from k3serve.openai_api.deltas import DeltaTracker
from k3serve.openai_api.validate import check_params_token_ids
from k3serve.proto import worker_pb2 as pb
from k3serve.proto import worker_pb2_grpc as pb_grpc
from k3serve.proto.convert import (
    MAX_EVENTS_PER_MESSAGE,
    deltas_to_proto,
    kv_batch_to_proto,
    kv_transfer_params_from_proto,
    kv_transfer_params_to_proto,
    sampling_kwargs_from_proto,
)
from k3serve.sampling_params import SamplingParams, SamplingParamsError
from k3serve.workers.async_engine import (
    AsyncEngine,
    DuplicateRequestError,
    EngineDeadError,
    RequestFailedError,
)
from k3serve.workers.kv_events import DEFAULT_MAX_QUEUED_BATCHES, KvEventHub, SubscriberTooSlow
from k3serve.workers.kv_transfer import grpc_pd
from k3serve.workers.kv_transfer.compat import IncompatiblePeer

log = logging.getLogger(__name__)

ROLES = ("both", "prefill", "decode")


class WorkerService(pb_grpc.WorkerServicer):
    def __init__(self, engine: AsyncEngine, *, role: str, model_name: str,
                 max_queued_batches: int = DEFAULT_MAX_QUEUED_BATCHES,
                 max_events_per_message: int = MAX_EVENTS_PER_MESSAGE):
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        self.engine = engine
        self.role = role
        self.model_name = model_name
        self.kv_events = KvEventHub(engine, max_queued_batches=max_queued_batches)
        self.max_events_per_message = max_events_per_message
        self._nixl = False  # the engine's NIXL connector (looked up on first use), or None
        self.address = ("127.0.0.1", 0)  # this server's gRPC address (start_grpc_server sets it)

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        if not request.request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id: must be non-empty")
        if not request.prompt_token_ids:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids: must be non-empty")
        try:
            params = SamplingParams(**sampling_kwargs_from_proto(request.sampling_params))
            check_params_token_ids(params, self.engine.vocab_size)
        except (SamplingParamsError, TypeError, ValueError) as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"sampling_params: {e}")
        salt = request.cache_salt if request.HasField("cache_salt") else None
        # P/D (docs/serving.md "P/D: prefill, then decode"; workers/kv_transfer/grpc_pd.py)
        pd = await self._pd_plan(request, params, context)
        if pd.mode == "prefill":
            async for msg in self._prefill_hop(request, salt, context):
                yield msg
            return
        try:
            stream = await self.engine.add_request(request.request_id, list(request.prompt_token_ids), params, salt,
                                                   kv_transfer_params=pd.params)
        except DuplicateRequestError as e:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(e))
        except EngineDeadError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        tracker = DeltaTracker()
        try:
            async for out in stream:
                deltas = tracker.update(out)
                msg = pb.GenerateResponse(request_id=request.request_id, outputs=deltas_to_proto(deltas),
                                          prompt_tokens=tracker.prompt_tokens,
                                          cached_tokens=tracker.cached_tokens, finished=out.finished)
                if out.finished and pd.mode == "decode":
                    res = grpc_pd.decode_result(self.nixl, pd, request.request_id)
                    msg.kv_transfer_result.CopyFrom(pb.KvTransferResult(**res))
                yield msg
        except (EngineDeadError, RequestFailedError) as e:
            await context.abort(grpc.StatusCode.INTERNAL, str(e))
        finally:
            stream.abort()

    # -- P/D ----------------------------------------------------------------------------------
    @property
    def nixl(self):
        if self._nixl is False:
            self._nixl = grpc_pd.find_nixl(getattr(self.engine, "engine", None))
        return self._nixl

    async def _pd_plan(self, request, params, context) -> grpc_pd.PDPlan:
        import asyncio

        if not request.HasField("kv_transfer_params"):
            return grpc_pd.PDPlan("plain")
        kvp = kv_transfer_params_from_proto(request.kv_transfer_params)
        try:  # a thread: naming a compatibility mismatch asks the prefill worker
            return await asyncio.to_thread(grpc_pd.pd_plan, kvp, self.nixl, self.role, params.n)
        except grpc_pd.PDRefused as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))

    async def _prefill_hop(self, request, salt, context):
        """Compute the prompt one token short, pin its pages, answer the transfer parameters."""
        rid, prompt = request.request_id, list(request.prompt_token_ids)
        host, port = self.address
        if len(prompt) == 1:
            kvp = grpc_pd.empty_transfer_params(self.nixl, rid, host, port)
            yield pb.GenerateResponse(request_id=rid, prompt_tokens=1, finished=True,
                                      kv_transfer_params=kv_transfer_params_to_proto(kvp))
            return
        try:
            stream = await self.engine.add_request(rid, prompt[:-1], grpc_pd.prefill_sampling(), salt,
                                                   kv_transfer_params={"do_remote_decode": True})
        except DuplicateRequestError as e:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(e))
        except EngineDeadError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        last = None
        try:
            async for out in stream:
                last = out
        except (EngineDeadError, RequestFailedError) as e:
            await context.abort(grpc.StatusCode.INTERNAL, str(e))
        finally:
            stream.abort()
        kvp = getattr(last, "kv_transfer_params", None) if last is not None else None
        if kvp is None:
            await context.abort(grpc.StatusCode.INTERNAL, "the prefill finished without pinning its pages")
        yield pb.GenerateResponse(request_id=rid, prompt_tokens=len(prompt), cached_tokens=last.num_cached_tokens,
                                  finished=True, kv_transfer_params=kv_transfer_params_to_proto(
                                      grpc_pd.transfer_params_out(self.nixl, kvp, host, port)))

    async def GetTransferMetadata(self, request: pb.TransferMetadataRequest, context):
        try:
            return grpc_pd.transfer_metadata(self.nixl, pb, request)
        except (grpc_pd.PDRefused, IncompatiblePeer) as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except RuntimeError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))

    async def Abort(self, request: pb.AbortRequest, context) -> pb.AbortResponse:
        return pb.AbortResponse(found=self.engine.abort(request.request_id))

    async def Health(self, request: pb.HealthRequest, context) -> pb.HealthResponse:
        if self.engine.is_healthy():
            return pb.HealthResponse(status=pb.HealthResponse.SERVING, message="ok", role=self.role,
                                     model=self.model_name)
        reason = str(self.engine.error) if self.engine.error is not None else "engine is not running"
        return pb.HealthResponse(status=pb.HealthResponse.NOT_SERVING, message=reason, role=self.role,
                                 model=self.model_name)

    async def GetLoad(self, request: pb.LoadRequest, context) -> pb.LoadResponse:
        s = self.engine.stats()
        return pb.LoadResponse(
            running=int(s.get("running", 0)), waiting=int(s.get("waiting", 0)),
            free_pages=int(s.get("free_pages", 0)), total_pages=int(s.get("total_pages", 0)),
            kv_usage=float(s.get("kv_usage", 0.0)), kda_slots_used=int(s.get("kda_slots_used", 0)),
            kda_slots_total=int(s.get("kda_slots_total", 0)), max_model_len=self.engine.max_model_len,
            model=self.model_name, role=self.role, kv_event_sequence=self.kv_events.last_sequence)

    async def StoreLookup(self, request: pb.StoreLookupRequest, context) -> pb.StoreLookupResponse:
        """How much of the prompt the Mooncake store can supply (k3serve/kvstore/connector.py)."""
        import asyncio

        from k3serve.kvstore.connector import store_lookup

        salt = request.cache_salt if request.HasField("cache_salt") else None
        status, tokens, block, unit = await asyncio.to_thread(
            store_lookup, self.engine, list(request.prompt_token_ids), salt)
        codes = {"ok": pb.StoreLookupResponse.OK, "no_store": pb.StoreLookupResponse.NO_STORE,
                 "unavailable": pb.StoreLookupResponse.UNAVAILABLE,
                 "deadline": pb.StoreLookupResponse.DEADLINE_EXCEEDED}
        return pb.StoreLookupResponse(status=codes[status], num_tokens=tokens, block_size=block, hash_unit=unit)

    async def SubscribeKvEvents(self, request: pb.KvEventsRequest, context: grpc.aio.ServicerContext):
        try:
            sub = await self.kv_events.subscribe()
        except EngineDeadError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        hub = self.kv_events
        try:
            while True:
                try:
                    batch = await sub.get()
                except SubscriberTooSlow as e:
                    log.warning("dropping a KV-event subscriber: %s", e)
                    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
                except EngineDeadError as e:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
                for msg in kv_batch_to_proto(batch.sequence, batch.snapshot, batch.events, hub.instance_id,
                                             self.max_events_per_message):
                    yield msg
        finally:
            sub.close()


class GrpcServer:
    """A started grpc.aio server and its bound port."""

    def __init__(self, server: grpc.aio.Server, port: int, service: WorkerService):
        self.server = server
        self.port = port
        self.service = service

    async def stop(self, grace: float | None = 2.0) -> None:
        """Stop serving; open SubscribeKvEvents streams end at once with UNAVAILABLE (they never finish alone)."""
        self.service.kv_events.end_all()
        await self.server.stop(grace)
        self.service.kv_events.close()


async def start_grpc_server(engine: AsyncEngine, *, host: str = "127.0.0.1", port: int = 0, role: str = "both",
                            model_name: str, max_queued_batches: int = DEFAULT_MAX_QUEUED_BATCHES,
                            max_events_per_message: int = MAX_EVENTS_PER_MESSAGE,
                            extra_addresses: tuple[str, ...] = ()) -> GrpcServer:
    """`max_queued_batches`: KV-event batches a subscriber may fall behind before it is dropped.
    `extra_addresses`: more listening addresses for the same service (e.g. `unix:/path`, `k3serve up --store`)."""
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    service = WorkerService(engine, role=role, model_name=model_name, max_queued_batches=max_queued_batches,
                            max_events_per_message=max_events_per_message)
    pb_grpc.add_WorkerServicer_to_server(service, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        service.kv_events.close()
        raise OSError(f"could not bind gRPC on {host}:{port}")
    for addr in extra_addresses:
        if server.add_insecure_port(addr) == 0:
            service.kv_events.close()
            raise OSError(f"could not bind gRPC on {addr}")
    service.address = (host, bound)
    await server.start()
    return GrpcServer(server, bound, service)
