"""Host <-> device copies of the cuda backend: every byte between NumPy and a GPU passes here.

An upload is staged through a small pool of page-locked (pinned) host buffers and copied on a
dedicated upload stream per device. The host returns as soon as the copy is enqueued, the copy
overlaps kernels already running on the compute stream, and the compute stream waits on an event
recorded after the copy, so every kernel enqueued afterwards sees the data. A download copies
through the same pool on the compute stream and then waits for an event recorded after its own
copy: a read synchronises with the work that produces its value, never with the whole device.

Under the interpreter (EMBER_INTERPRET=1) the cuda device is the CPU and a transfer is a plain copy.
"""

from __future__ import annotations

import threading
from collections import deque

import numpy as np
import torch

from ember import dtypes
from ember.device import Device
from ember.runtime.cuda import torch_device

STAGING_BYTES = 8 << 20  # one staging buffer; larger copies pass through in chunks of this size
MAX_STAGING = 4  # staging buffers kept per device; when all are busy an upload waits for the oldest

stats = {"uploads": 0, "bytes_uploaded": 0, "downloads": 0, "bytes_downloaded": 0, "staging_buffers": 0}


class _Staging:
    """A pinned host buffer and the event recorded after the last copy through it."""

    def __init__(self) -> None:
        self.host = torch.empty(STAGING_BYTES, dtype=torch.uint8, pin_memory=True)
        self.bytes = self.host.numpy()  # the same page-locked memory, for NumPy's copies
        self.event = torch.cuda.Event()
        stats["staging_buffers"] += 1

    def idle(self) -> bool:
        return self.event.query()  # also true before the first copy


_pools: dict[int, list[_Staging]] = {}  # per device index, least recently used first
_pool_lock = threading.Lock()  # uploads and downloads may come from several threads
_upload_streams: dict[int, torch.cuda.Stream] = {}


def upload_stream(device: Device) -> torch.cuda.Stream:
    """The stream that carries uploads to `device` (a real GPU), created on first use."""
    target = torch_device(device)
    if target.index not in _upload_streams:
        _upload_streams[target.index] = torch.cuda.Stream(target)
    return _upload_streams[target.index]


def _take(index: int, wait: bool) -> _Staging:
    """Take out of the pool a buffer whose last copy has finished, or make one when all are busy.
    With `wait`, a full pool of busy buffers waits for its oldest copy instead of growing (uploads:
    back-pressure); downloads never wait, since they must not wait for an unrelated upload."""
    with _pool_lock:
        pool = _pools.setdefault(index, [])
        staging = next((s for s in pool if s.idle()), None)
        if staging is None and wait and len(pool) >= MAX_STAGING:
            staging = pool[0]
        if staging is not None:
            pool.remove(staging)
    if staging is None:
        return _Staging()
    staging.event.synchronize()  # at once for an idle buffer
    return staging


def _give_back(index: int, staging: _Staging) -> None:
    """Return a buffer once its copy is enqueued (its event tells when it is done); one beyond
    MAX_STAGING is dropped, and torch's pinned-memory cache keeps it until that copy is done."""
    with _pool_lock:
        pool = _pools[index]
        if len(pool) < MAX_STAGING:
            pool.append(staging)  # the pool runs from the oldest copy to the newest


def upload(array: np.ndarray, device: Device) -> torch.Tensor:
    """A new tensor on `device` holding a copy of `array`; the array may change as soon as this returns."""
    target = torch_device(device)
    dtype = dtypes.from_numpy(array.dtype)
    stats["uploads"] += 1
    stats["bytes_uploaded"] += array.nbytes
    if target.type == "cpu":  # the interpreter: a CPU tensor that never aliases the array
        return _cpu_tensor(np.array(array, dtype=dtype.np, order="C", copy=True))
    source = np.ascontiguousarray(array, dtype=dtype.np).reshape(-1).view(np.uint8)

    def fill(staging: _Staging, start: int, n: int) -> None:
        staging.bytes[:n] = source[start:start + n]  # the only copy the host waits for

    pieces = [(start, min(STAGING_BYTES, source.size - start)) for start in range(0, source.size, STAGING_BYTES)]
    dest, done = _staged(device, array.shape, dtypes.to_torch(dtype), pieces, fill)
    torch.cuda.current_stream(target).wait_event(done)
    return dest


def upload_rows(array: np.ndarray, rows: np.ndarray, device: Device) -> tuple[torch.Tensor, object]:
    """`array[rows]` on `device`, gathered straight into pinned staging buffers (one host copy, by
    torch's multi-threaded gather). Returns the tensor and the event its copy completes with: pass it
    to `wait` when the tensor is handed out, so that compute enqueued before then (the step on the
    batch before) does not wait for this copy."""
    target = torch_device(device)
    row_bytes = array[0].nbytes if array.shape[0] else 0
    if target.type == "cpu" or not array.flags.c_contiguous or row_bytes == 0 or row_bytes > STAGING_BYTES:
        return upload(array[rows], device), None
    stats["uploads"] += 1
    stats["bytes_uploaded"] += row_bytes * len(rows)
    source = _cpu_tensor(array)
    rows = torch.from_numpy(np.asarray(rows, dtype=np.int64))

    def fill(staging: _Staging, start: int, n: int) -> None:
        chunk = rows[start // row_bytes:(start + n) // row_bytes]
        gathered = staging.host[:n].view(source.dtype).view(len(chunk), *array.shape[1:])
        torch.index_select(source, 0, chunk, out=gathered)

    per_chunk = STAGING_BYTES // row_bytes * row_bytes
    total = len(rows) * row_bytes
    pieces = [(start, min(per_chunk, total - start)) for start in range(0, total, per_chunk)]
    return _staged(device, (len(rows), *array.shape[1:]), source.dtype, pieces, fill)


def _staged(device: Device, shape: tuple[int, ...], dtype: torch.dtype, pieces: list[tuple[int, int]],
            fill) -> tuple[torch.Tensor, torch.cuda.Event]:
    """A new device tensor filled through staging buffers: for each (byte offset, byte count) piece,
    `fill(staging, offset, count)` writes the bytes into a pinned buffer, which is then copied on the
    upload stream. Returns the tensor and an event recorded after the last copy."""
    target = torch_device(device)
    compute = torch.cuda.current_stream(target)
    stream = upload_stream(device)
    # The destination is allocated on the upload stream, not on the compute stream: a block the caching
    # allocator hands out on the compute stream may have been freed by a tensor that queued kernels still
    # read, which is safe for later compute-stream work but not for a copy on another stream (the upload
    # would have to wait for all queued compute, losing the overlap). Blocks of the upload stream's pool
    # were last written by earlier uploads, in order on this stream. `record_stream(compute)` makes the
    # allocator wait for the compute stream's use of this tensor before the block is handed out again.
    with torch.cuda.stream(stream):
        dest = torch.empty(shape, dtype=dtype, device=target)
    dest.record_stream(compute)
    dest_bytes = dest.view(-1).view(torch.uint8)
    for start, n in pieces:
        staging = _take(target.index, wait=True)
        fill(staging, start, n)
        with torch.cuda.stream(stream):
            dest_bytes[start:start + n].copy_(staging.host[:n], non_blocking=True)
        staging.event.record(stream)
        _give_back(target.index, staging)
    done = torch.cuda.Event()  # of its own: a staging buffer's event moves on to its next copy
    done.record(stream)
    return dest, done


def wait(event, device: Device) -> None:
    """Make the current stream wait for an upload's event (None: nothing to wait for)."""
    if event is not None:
        torch.cuda.current_stream(torch_device(device)).wait_event(event)


def download(buffer: torch.Tensor) -> np.ndarray:
    """A new NumPy array holding a copy of `buffer`. Waits for the work queued before it on the
    compute stream (which computes the value) and for nothing else."""
    dtype = dtypes.as_dtype(buffer.dtype)
    buffer = buffer.detach()
    stats["downloads"] += 1
    stats["bytes_downloaded"] += buffer.numel() * buffer.element_size()
    if not buffer.is_cuda:  # the interpreter
        return np.array(_cpu_array(buffer), copy=True)
    out = np.empty(buffer.shape, dtype=dtype.np)
    if out.size == 0:
        return out
    out_bytes = out.reshape(-1).view(np.uint8)
    index = buffer.device.index
    with torch.cuda.device(buffer.device):
        stream = torch.cuda.current_stream()
        source = buffer.contiguous().view(-1).view(torch.uint8)
        # Two chunks in flight: the device copies one while the host copies the other out.
        in_flight: deque[tuple[_Staging, int, int]] = deque()
        for start in range(0, out_bytes.size, STAGING_BYTES):
            if len(in_flight) == 2:
                _copy_out(index, *in_flight.popleft(), out_bytes)
            n = min(STAGING_BYTES, out_bytes.size - start)
            staging = _take(index, wait=False)  # held until copied out: its event alone does not say so
            staging.host[:n].copy_(source[start:start + n], non_blocking=True)
            staging.event.record(stream)
            in_flight.append((staging, start, n))
        while in_flight:
            _copy_out(index, *in_flight.popleft(), out_bytes)
    return out


def _copy_out(index: int, staging: _Staging, start: int, n: int, out_bytes: np.ndarray) -> None:
    staging.event.synchronize()
    out_bytes[start:start + n] = staging.bytes[:n]
    _give_back(index, staging)


def _cpu_tensor(array: np.ndarray) -> torch.Tensor:
    """A torch CPU tensor sharing `array`'s memory; torch knows no ml_dtypes, so bfloat16 goes
    through an int16 view."""
    if array.dtype == dtypes.bfloat16.np:
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def _cpu_array(tensor: torch.Tensor) -> np.ndarray:
    """A NumPy view of a torch CPU tensor (bfloat16 through int16, as in `_cpu_tensor`)."""
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(dtypes.bfloat16.np)
    return tensor.numpy()
