"""One host->device copy for a fixed-shape step's inputs (speculative steps: verify, MTP observe, MTP drafts).

`Staging(fields, device)`: `fields` = {name: (dtype, shape)}; the fields are packed, each 8-byte aligned, in ONE byte
buffer on the device. `host()` gives numpy views of a host buffer to fill; `send()` copies it to the device in one
copy (on CUDA from pinned memory, asynchronous: no host sync) and returns the device views, always the same tensors
(a captured CUDA graph reads fixed addresses). Two host buffers alternate; a buffer is written again only after its
previous copy has run (an event wait, normally long done). On the CPU the host buffer IS the device buffer.
workers/engine/model_runner.py `DecodeStaging` does the same for decode steps with its own fixed layout.
"""

from __future__ import annotations

import numpy as np
import torch


class Staging:
    def __init__(self, fields: dict[str, tuple[torch.dtype, tuple[int, ...]]], device: torch.device):
        self.device = torch.device(device)
        self.layout: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
        off = 0
        for name, (dtype, shape) in fields.items():
            n = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
            self.layout[name] = (dtype, tuple(shape), off, n)
            off += -(-n // 8) * 8
        self.nbytes = max(off, 8)
        self.device_buf = torch.zeros(self.nbytes, dtype=torch.uint8, device=self.device)
        if self.device.type == "cuda":
            self.host_bufs = [torch.zeros(self.nbytes, dtype=torch.uint8).pin_memory() for _ in range(2)]
        else:
            self.host_bufs = [self.device_buf]
        self.copied: list = [None] * len(self.host_bufs)
        self.turn = 0
        self.dev = self._views(self.device_buf)
        self._host = [{k: v.numpy() for k, v in self._views(b).items()} for b in self.host_bufs]

    def _views(self, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        return {name: buf[off:off + n].view(dtype).view(shape) for name, (dtype, shape, off, n) in self.layout.items()}

    def host(self) -> dict[str, np.ndarray]:
        """Numpy views of the host buffer the next `send` copies (fill every field the step reads)."""
        ev = self.copied[self.turn]
        if ev is not None:
            ev.synchronize()
        return self._host[self.turn]

    def send(self) -> dict[str, torch.Tensor]:
        t = self.turn
        if self.host_bufs[t] is not self.device_buf:
            self.device_buf.copy_(self.host_bufs[t], non_blocking=True)
            ev = self.copied[t] or torch.cuda.Event()
            ev.record()
            self.copied[t] = ev
            self.turn = 1 - t
        return self.dev
