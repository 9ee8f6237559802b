"""The worker's gRPC service (worker.proto) over an AsyncEngine, on grpc.aio.

    server = await start_grpc_server(async_engine, host="127.0.0.1", port=0, role="both", model_name="k3")
    server.port                      # the bound port
    await server.stop(grace=2.0)

Generate streams one GenerateResponse per engine output that changed (deltas; see worker.proto for
the status codes). A cancelled call aborts the request in the engine.
"""

from __future__ import annotations

import logging

import grpc

from k3serve.workers.async_engine import AsyncEngine, DuplicateRequestError, EngineDeadError
from k3serve.workers.grpc_convert import deltas_to_proto, sampling_kwargs_from_proto
from k3serve.workers.proto import worker_pb2 as pb
from k3serve.workers.proto import worker_pb2_grpc as pb_grpc
from k3serve.workers.sampling_params import SamplingParams, SamplingParamsError
from k3serve.workers.serving.deltas import DeltaTracker
from k3serve.workers.serving.validate import check_params_token_ids

log = logging.getLogger(__name__)

ROLES = ("both", "prefill", "decode")


class WorkerService(pb_grpc.WorkerServicer):
    def __init__(self, engine: AsyncEngine, *, role: str, model_name: str):
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        self.engine = engine
        self.role = role
        self.model_name = model_name

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
        try:
            stream = await self.engine.add_request(request.request_id, list(request.prompt_token_ids), params, salt)
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
                yield pb.GenerateResponse(request_id=request.request_id, outputs=deltas_to_proto(deltas),
                                          prompt_tokens=tracker.prompt_tokens,
                                          cached_tokens=tracker.cached_tokens, finished=out.finished)
        except EngineDeadError as e:
            await context.abort(grpc.StatusCode.INTERNAL, str(e))
        finally:
            stream.abort()

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
            model=self.model_name, role=self.role)


class GrpcServer:
    """A started grpc.aio server and its bound port."""

    def __init__(self, server: grpc.aio.Server, port: int):
        self.server = server
        self.port = port

    async def stop(self, grace: float | None = 2.0) -> None:
        await self.server.stop(grace)


async def start_grpc_server(engine: AsyncEngine, *, host: str = "127.0.0.1", port: int = 0, role: str = "both",
                            model_name: str) -> GrpcServer:
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    pb_grpc.add_WorkerServicer_to_server(WorkerService(engine, role=role, model_name=model_name), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"could not bind gRPC on {host}:{port}")
    await server.start()
    return GrpcServer(server, bound)
