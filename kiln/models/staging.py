"""Copies checkpoint tensors to a GPU through pinned memory. A copy from safetensors' mmap view is pageable:
the driver stages it through a buffer of its own, one blocking copy at a time (an 8B model's 15 GB loaded
at 4 GB/s on the H100 machine). Here threads read each tensor's bytes from the file (pread, from the page
cache) into a ring of pinned buffers, and a side stream copies each filled buffer to the device while the
next ones are read. A copy that converts (a float32 checkpoint served in 16 bits) lands each chunk in a
device buffer and converts it there: torch would convert the whole tensor on the host first, then copy it
pageable."""

from __future__ import annotations

import contextlib
import json
import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

# Untuned on a GPU host. On the 2-core VM this ring read a file in the page cache at 22-27 GB/s, a copy out
# of the mmap view at 10-17 (perf/read_bench.py).
CHUNK = 8 << 20
BUFFERS = 8
THREADS = 4


def data_offsets(file: Path) -> dict[str, int]:
    """Each tensor's first byte in a safetensors file, which starts with its JSON header's length (8 bytes,
    little-endian) and the header, whose data_offsets count from the header's end."""
    with open(file, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    return {
        name: 8 + size + entry["data_offsets"][0] for name, entry in header.items() if name != "__metadata__"
    }


class Stager:
    def __init__(
        self, device: torch.device, chunk: int = CHUNK, buffers: int = BUFFERS, threads: int = THREADS
    ) -> None:
        """On a CPU device the buffers are not pinned and the copies are synchronous (the tests' path)."""
        cuda = device.type == "cuda"
        self.chunk = chunk
        self.buffers = [torch.empty(chunk, dtype=torch.uint8, pin_memory=cuda) for _ in range(buffers)]
        self.arrays = [b.numpy() for b in self.buffers]  # what os.preadv fills
        self.stream = torch.cuda.Stream(device) if cuda else None
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(device))
        self.device = device
        self.landing: list[torch.Tensor] = []  # on the device, one per buffer: a converting copy's source
        # Each buffer's copy to the device, which must end before the buffer is read into again.
        self.copied: list[torch.cuda.Event | None] = [None] * buffers
        # (buffer, its read, where it goes, the file's dtype), in the order the buffers are taken
        self.reads: deque[tuple[int, Future[int], torch.Tensor, torch.dtype]] = deque()
        self.next = 0
        self.files: dict[Path, tuple[int, dict[str, int]]] = {}  # open file -> (fd, data_offsets)
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="kiln-weights")

    def __enter__(self) -> Stager:
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        """Lands every copy (after an error, none) and closes the files."""
        try:
            while kind is None and self.reads:
                self._land(*self.reads.popleft())
        finally:
            self.pool.shutdown()  # the reads in flight end before their files close
            if self.stream is not None:
                self.stream.synchronize()
            self.landing = []  # 64 MiB of the device, for a Stager its caller keeps
            for fd, _ in self.files.values():
                os.close(fd)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, file: Path, name: str) -> None:
        """dst <- src, the tensor `name` of the safetensors file `file`, in chunks of whole elements. A copy
        that transposes (GPT-2's weights) goes the plain way."""
        if not (src.is_contiguous() and dst.is_contiguous()):
            dst.copy_(src)
            return
        if file not in self.files:
            self.files[file] = (os.open(file, os.O_RDONLY), data_offsets(file))
        fd, offsets = self.files[file]
        offset = offsets[name]
        size = src.element_size()
        step = self.chunk // size
        if src.dtype != dst.dtype and not self.landing:
            with self._side():  # the side stream alone uses them: the allocator pairs them with it
                self.landing = [torch.empty_like(b, device=self.device) for b in self.buffers]
        out = dst.view(-1)
        for start in range(0, out.numel(), step):
            if len(self.reads) == len(self.buffers):
                self._land(*self.reads.popleft())
            i, self.next = self.next, (self.next + 1) % len(self.buffers)
            if (event := self.copied[i]) is not None:
                event.synchronize()
            part = out[start : start + step]
            read = self.pool.submit(
                os.preadv, fd, [self.arrays[i][: part.numel() * size]], offset + start * size
            )
            self.reads.append((i, read, part, src.dtype))

    def _side(self) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def _land(self, i: int, read: Future[int], part: torch.Tensor, dtype: torch.dtype) -> None:
        size = part.numel() * dtype.itemsize
        if (got := read.result()) != size:
            raise OSError(f"short read: {got} of {size} bytes")
        src = self.buffers[i][:size]
        with self._side():
            if dtype != part.dtype:
                src = self.landing[i][:size].copy_(src, non_blocking=True)
            part.copy_(src.view(dtype), non_blocking=True)
            if self.stream is not None:
                self.copied[i] = self.stream.record_event()
