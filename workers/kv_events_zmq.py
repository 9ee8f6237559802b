"""The worker's KV events in vLLM's ZMQ/msgpack format (`--kv-events-zmq ENDPOINT`), for vLLM-ecosystem routers.

    pub = start_zmq_publisher(async_engine, "tcp://127.0.0.1:5557", replay_endpoint="tcp://127.0.0.1:5558")
    pub.stop()

Wire format (what vLLM's `ZmqEventPublisher` sends, so its subscribers parse it unchanged):
* PUB socket bound at ENDPOINT; every message is three frames `[topic, seq, payload]`: `topic` (bytes,
  default empty), `seq` an 8-byte big-endian signed counter from 0, `payload` msgpack of a
  `KVEventBatch` in msgspec's array form: `[ts, [event, ...], data_parallel_rank]`.
* events are tagged arrays: `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
  lora_id, medium]`, `["BlockRemoved", block_hashes, medium]`, `["AllBlocksCleared"]`; with
  `--kv-events-zmq-format map` internally tagged maps instead (`{"type": "BlockStored", "block_hashes": ...}`),
  the form vllm-router 0.1.17's kv_aware subscriber decodes.
* optional replay (ROUTER) socket: a client sends `seq` (8 bytes big-endian) and gets every buffered batch
  from it as `[identity, b"", seq, payload]`, then the end marker `[identity, b"", -1, b""]`.

What maps and what does not: vLLM's events describe attention blocks only. A k3serve MLA key at a full
block boundary becomes one BlockStored/BlockRemoved with our 32-byte chained hash as the block hash
(k3serve/common/block_hash.py) and the previous block's hash as the parent. KDA state snapshots and
MLA keys inside a block have no vLLM counterpart and are not published — which is exactly why an
attention-only consumer over-estimates reuse on a hybrid model. `token_ids` is empty: our events carry
hashes, not tokens. A new subscription of the publisher starts with AllBlocksCleared then the cache's
contents (the snapshot), so a consumer that joins late still converges.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import struct
import threading
import time

import msgpack

log = logging.getLogger(__name__)

MEDIUM = "GPU"  # vLLM's name for the engine's own KV cache tier


_FIELDS = {"BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium"),
           "BlockRemoved": ("block_hashes", "medium"), "AllBlocksCleared": ()}
FORMATS = ("array", "map")


def vllm_events(events, fmt: str = "array") -> list:
    """k3serve KVEvent-like objects (fields of k3serve/kv_events/types.py) -> vLLM events: tagged arrays
    (`fmt="array"`, msgspec's array_like form) or internally tagged maps (`fmt="map"`, {"type": ..., field: ...},
    the form vllm-router 0.1.17 decodes)."""
    out: list = []
    for ev in events:
        if ev.group_kind != "mla" or not ev.block_size or ev.num_tokens % ev.block_size:
            continue
        h = bytes(ev.block_hash)
        if ev.kind == "stored":
            parent = bytes(ev.parent_hash) if ev.parent_hash is not None else None
            out.append(["BlockStored", [h], parent, [], int(ev.block_size), None, MEDIUM])
        else:
            out.append(["BlockRemoved", [h], MEDIUM])
    return [as_format(e, fmt) for e in out]


def as_format(event: list, fmt: str):
    if fmt == "array":
        return event
    if fmt != "map":
        raise ValueError(f"KV event format must be one of {FORMATS}, got {fmt!r}")
    out = {"type": event[0], **dict(zip(_FIELDS[event[0]], event[1:]))}
    if event[0] == "BlockStored":
        out.update(lora_name=None, extra_keys=None)  # newer vLLM fields (no LoRA, no multimodal keys)
    return out


def encode_batch(events: list[list], ts: float | None = None, dp_rank: int | None = None) -> bytes:
    return msgpack.packb([time.time() if ts is None else ts, events, dp_rank], use_bin_type=True)


class ZmqKvEventPublisher:
    """Runs on its own thread and event loop; consumes a KvEventHub subscription (workers/kv_events.py)."""

    def __init__(self, async_engine, endpoint: str, *, replay_endpoint: str | None = None, topic: str = "",
                 buffer_steps: int = 10_000, hub=None, dp_rank: int | None = None, fmt: str = "array"):
        from k3serve.workers.kv_events import KvEventHub

        self.engine = async_engine
        self.endpoint, self.replay_endpoint, self.topic = endpoint, replay_endpoint, topic.encode()
        self.hub = hub or KvEventHub(async_engine)
        self._own_hub = hub is None
        self.dp_rank = dp_rank
        as_format(["AllBlocksCleared"], fmt)  # validates
        self.fmt = fmt
        self.buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=buffer_steps)
        self.seq = 0
        self.published_events = 0
        self._thread = threading.Thread(target=self._main, name="kv-events-zmq", daemon=True)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self.error: BaseException | None = None

    def start(self) -> ZmqKvEventPublisher:
        self._thread.start()
        self._ready.wait(10)
        if self.error is not None:
            raise self.error
        return self

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(5)
        if self._own_hub:
            self.hub.close()

    def _main(self) -> None:
        try:
            asyncio.run(self._run())
        except BaseException as e:  # noqa: BLE001 - reported through .error and the log
            self.error = e
            self._ready.set()
            log.error("KV-event ZMQ publisher stopped: %s", e)

    async def _run(self) -> None:
        import zmq
        import zmq.asyncio

        ctx = zmq.asyncio.Context()
        pub = ctx.socket(zmq.PUB)
        pub.bind(self.endpoint)
        replay = None
        if self.replay_endpoint:
            replay = ctx.socket(zmq.ROUTER)
            replay.bind(self.replay_endpoint)
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self._ready.set()
        tasks = [asyncio.ensure_future(self._pump(pub))]
        if replay is not None:
            tasks.append(asyncio.ensure_future(self._serve_replay(replay)))
        try:
            await self._stop.wait()
        finally:
            for t in tasks:
                t.cancel()
            for t in tasks:
                try:
                    await t
                except BaseException:  # noqa: BLE001 - shutting down
                    pass
            pub.close(0)
            if replay is not None:
                replay.close(0)
            ctx.term()

    async def _send(self, pub, events: list[list]) -> None:
        payload = encode_batch(events, dp_rank=self.dp_rank)
        seq = self.seq
        self.seq += 1
        self.buffer.append((seq, payload))
        self.published_events += len(events)
        await pub.send_multipart([self.topic, struct.pack(">q", seq), payload])

    async def _pump(self, pub) -> None:
        from k3serve.workers.async_engine import EngineDeadError
        from k3serve.workers.kv_events import SubscriberTooSlow

        while True:
            try:
                sub = await self.hub.subscribe()
            except EngineDeadError:
                return
            try:
                while True:
                    batch = await sub.get()
                    events = vllm_events(batch.events, self.fmt)
                    if batch.snapshot:
                        events = [as_format(["AllBlocksCleared"], self.fmt), *events]
                    if events:
                        await self._send(pub, events)
            except SubscriberTooSlow:
                log.warning("KV-event ZMQ publisher fell behind; restarting from a snapshot")
            except EngineDeadError:
                return
            finally:
                sub.close()

    async def _serve_replay(self, sock) -> None:
        while True:
            frames = await sock.recv_multipart()
            if len(frames) < 2:
                continue
            ident, body = frames[0], frames[-1]
            try:
                (start,) = struct.unpack(">q", body)
            except struct.error:
                start = 0
            for seq, payload in list(self.buffer):
                if seq >= start:
                    await sock.send_multipart([ident, b"", struct.pack(">q", seq), payload])
            await sock.send_multipart([ident, b"", struct.pack(">q", -1), b""])


def start_zmq_publisher(async_engine, endpoint: str, *, replay_endpoint: str | None = None, hub=None,
                        topic: str = "", fmt: str = "array") -> ZmqKvEventPublisher:
    return ZmqKvEventPublisher(async_engine, endpoint, replay_endpoint=replay_endpoint, hub=hub, topic=topic,
                               fmt=fmt).start()


def add_zmq_args(parser) -> None:
    """`--kv-events-zmq ENDPOINT [--kv-events-zmq-replay ENDPOINT] [--kv-events-zmq-topic T]` (serve, worker)."""
    parser.add_argument("--kv-events-zmq", default=None, metavar="ENDPOINT",
                        help="also publish KV events in vLLM's ZMQ/msgpack format here (e.g. tcp://127.0.0.1:5557)")
    parser.add_argument("--kv-events-zmq-replay", default=None, metavar="ENDPOINT",
                        help="replay (ROUTER) endpoint for --kv-events-zmq")
    parser.add_argument("--kv-events-zmq-topic", default="", metavar="TOPIC", help="topic frame of every message")
    parser.add_argument("--kv-events-zmq-format", default="array", choices=FORMATS,
                        help="events as msgspec tagged arrays (vLLM) or tagged maps (vllm-router 0.1.17)")
