"""Transfers on a real GPU (`pytest -m gpu`): pinned staging buffers are reused, uploads overlap
compute without blocking the host, and a download waits for its own copy only."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import ember
from ember.data import DataLoader
from ember.device import as_device

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("EMBER_INTERPRET", "0") != "0",
                       reason="needs a CUDA GPU (and EMBER_INTERPRET unset)"),
]

CUDA = as_device("cuda")
SLEEP_CYCLES = 2_000_000_000  # about a second of a spinning kernel at GPU clocks


@pytest.fixture
def transfer():
    from ember.runtime import transfer

    torch.cuda.synchronize()
    return transfer


def long_kernel(stream: torch.cuda.Stream | None = None) -> torch.cuda.Event:
    """Enqueue a kernel that spins for about a second; the event completes when it ends."""
    stream = stream or torch.cuda.current_stream()
    done = torch.cuda.Event()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(SLEEP_CYCLES)
        done.record(stream)
    return done


def test_staging_buffers_are_reused_across_uploads(transfer):
    array = np.random.default_rng(0).standard_normal(1 << 18).astype(np.float32)  # 1 MiB
    before = transfer.stats["staging_buffers"]
    for _ in range(100):
        transfer.upload(array, CUDA)
    assert transfer.stats["staging_buffers"] - before <= transfer.MAX_STAGING
    torch.cuda.synchronize()
    settled = transfer.stats["staging_buffers"]
    for _ in range(100):  # one at a time: each copy is done before the next upload takes a buffer
        buffer = transfer.upload(array, CUDA)
        torch.cuda.synchronize()
    assert transfer.stats["staging_buffers"] == settled
    np.testing.assert_array_equal(transfer.download(buffer), array)


def test_an_upload_returns_and_copies_while_a_kernel_runs(transfer):
    array = np.arange(1 << 20, dtype=np.float32)
    transfer.upload(array, CUDA)  # the stream, the pool and a cached block of this size exist beforehand
    torch.cuda.synchronize()
    kernel_done = long_kernel()
    buffer = transfer.upload(array, CUDA)
    assert not kernel_done.query(), "upload blocked the host until the running kernel finished"
    copied = torch.cuda.Event()
    copied.record(transfer.upload_stream(CUDA))
    copied.synchronize()
    assert not kernel_done.query(), "the copy waited for the kernel instead of overlapping it"
    np.testing.assert_array_equal(transfer.download(buffer), array)  # the compute stream waited for the copy


def test_work_enqueued_after_an_upload_sees_its_data(transfer):
    array = np.random.default_rng(1).standard_normal((512, 512)).astype(np.float32)
    step = lambda x: (x * 2).sum(1)
    step(ember.tensor(np.zeros_like(array), device="cuda")).numpy()  # compiled before the timed part
    long_kernel(transfer.upload_stream(CUDA))  # the copy itself is held back behind a long kernel
    x = ember.tensor(array, device="cuda")
    np.testing.assert_allclose(step(x).numpy(), (array * 2).sum(1), rtol=1e-5, atol=1e-4)


def test_a_download_does_not_wait_for_an_unrelated_upload(transfer):
    value = torch.arange(1000, dtype=torch.float32, device="cuda")
    torch.cuda.synchronize()
    upload_stream = transfer.upload_stream(CUDA)
    blocker = long_kernel(torch.cuda.Stream())
    upload_stream.wait_event(blocker)  # the upload stream stalls behind the long kernel
    with torch.cuda.stream(torch.cuda.Stream()):  # an upload for other work, on another compute stream
        transfer.upload(np.ones(1 << 20, dtype=np.float32), CUDA)
    uploaded = torch.cuda.Event()
    uploaded.record(upload_stream)
    np.testing.assert_array_equal(transfer.download(value), np.arange(1000, dtype=np.float32))
    assert not uploaded.query(), "the download waited for the upload stream"
    assert not blocker.query()


def test_a_download_waits_for_the_work_that_computes_its_value(transfer):
    long_kernel()
    value = torch.full((4096,), 7.0, device="cuda")  # queued behind the long kernel
    np.testing.assert_array_equal(transfer.download(value), np.full(4096, 7.0, dtype=np.float32))


def test_large_transfers_go_through_the_staging_buffers_in_chunks(transfer):
    n = 3 * transfer.STAGING_BYTES // 8 + 123
    array = np.random.default_rng(2).standard_normal(n)
    buffer = transfer.upload(array[::-1], CUDA)
    np.testing.assert_array_equal(transfer.download(buffer), array[::-1])
    assert len(transfer._pools[0]) <= transfer.MAX_STAGING


def test_a_cuda_loader_yields_every_row_once_on_the_gpu():
    x = np.random.default_rng(3).standard_normal((66, 256)).astype(np.float32)
    batches = [batch for (batch,) in DataLoader(x, batch_size=16, device="cuda", prefetch=2)]
    assert [b.shape[0] for b in batches] == [16, 16, 16, 16, 2]
    np.testing.assert_array_equal(np.concatenate([b.numpy() for b in batches]), x)


def test_on_device_runs_a_region_on_the_gpu():
    x = np.random.default_rng(4).standard_normal((128, 64)).astype(np.float32)
    total = ember.on_device("cuda", lambda t: (t @ t.T).relu().sum(1), ember.tensor(x))
    assert total.device == ember.Device("cpu")
    np.testing.assert_allclose(total.numpy(), np.maximum(x @ x.T, 0).sum(1), rtol=1e-3, atol=1e-2)


# -- DLPack on the GPU: shared memory, stream-ordered ----------------------------------------------------

def test_from_dlpack_and_ember_tensor_of_a_torch_cuda_tensor_share_its_memory():
    t = torch.randn(256, 512, device="cuda")
    for e in (ember.from_dlpack(t), ember.tensor(t)):
        assert e.device == CUDA and e._node.buffer.data_ptr() == t.data_ptr()
        torch.testing.assert_close(torch.from_dlpack(e * 2), t * 2)
    e = ember.from_dlpack(t)
    t.add_(1)  # on torch's current stream, which ember computes on: ordered
    torch.testing.assert_close(torch.from_dlpack(e + 0), t)


def test_torch_from_dlpack_of_an_ember_cuda_tensor_shares_memory_and_is_stream_ordered():
    x = torch.randn(4096, 4096, device="cuda")
    e = (ember.from_dlpack(x) * 3).exp()  # pending: computed by the export
    assert e.__dlpack_device__() == (2, 0)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # the consumer's stream waits for the one that computed the value
        t = torch.from_dlpack(e)
        total = t.double().sum()
    side.synchronize()
    assert t.data_ptr() == e._node.buffer.data_ptr()
    expected = (x * 3).exp().double().sum()
    torch.testing.assert_close(total, expected, rtol=1e-5, atol=0)
    t.zero_()  # a write through torch is seen by ember once ordered
    torch.cuda.synchronize()
    assert float((e + 1).sum().item()) == 4096 * 4096


def test_cupy_shares_ember_cuda_memory_through_dlpack():
    cupy = pytest.importorskip("cupy")
    e = ember.tensor(np.arange(10, dtype=np.float32), device="cuda") * 2
    c = cupy.from_dlpack(e)
    assert c.data.ptr == e._node.buffer.data_ptr()
    np.testing.assert_array_equal(cupy.asnumpy(c), np.arange(10, dtype=np.float32) * 2)
    back = ember.from_dlpack(c)
    assert back._node.buffer.data_ptr() == c.data.ptr
