"""Host <-> device transfers (ember.runtime.transfer) and the DataLoader's device prefetch.

These run without a GPU through the interpreter (the cuda device is then the CPU and a transfer a plain
copy); on a GPU machine they exercise the pinned staging buffers and the upload stream. GPU-only
behaviour (pool reuse, overlap with compute, no waiting on unrelated copies) is in test_gpu_transfer.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import DTYPES, random_array

import ember
from ember.data import DataLoader, Dataset
from ember.device import as_device
from ember.ir import Op

pytestmark = pytest.mark.usefixtures("cuda_backend")

CUDA = as_device("cuda")


@pytest.fixture
def transfer():
    from ember.runtime import transfer

    return transfer


def layouts(array: np.ndarray) -> dict[str, np.ndarray]:
    """The same kind of data as contiguous, transposed, strided and reversed NumPy arrays."""
    out = {"contiguous": array}
    if array.ndim >= 2:
        out["transposed"] = array.T
    if array.ndim >= 1:
        out["strided"] = array[..., ::2]
        out["reversed"] = array[::-1]
    return out


def assert_identical(got: np.ndarray, want: np.ndarray) -> None:
    """Same dtype, shape and bytes (so NaN payloads and -0.0 count too)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    assert got.tobytes() == np.ascontiguousarray(want).tobytes()


@pytest.mark.parametrize("shape", [(), (7,), (3, 5), (2, 3, 4), (0, 3)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES)
def test_upload_then_download_round_trips_every_dtype_and_layout(transfer, rng, dtype, shape):
    for name, array in layouts(random_array(rng, shape, dtype, low=-100, high=100)).items():
        buffer = transfer.upload(array, CUDA)
        assert tuple(buffer.shape) == array.shape, name
        assert str(buffer.dtype).removeprefix("torch.") == dtype, name
        assert_identical(transfer.download(buffer), array)


def test_an_upload_never_aliases_the_array(transfer):
    array = np.arange(6, dtype=np.float32)
    buffer = transfer.upload(array, CUDA)
    array[:] = -1  # the caller may reuse its array as soon as upload returns
    np.testing.assert_array_equal(transfer.download(buffer), np.arange(6, dtype=np.float32))


def test_a_download_is_a_new_array(transfer):
    buffer = transfer.upload(np.arange(4, dtype=np.int32), CUDA)
    first = transfer.download(buffer)
    first[:] = 0
    np.testing.assert_array_equal(transfer.download(buffer), np.arange(4, dtype=np.int32))


def test_a_download_of_a_non_contiguous_buffer_reads_its_view(transfer):
    array = np.arange(24, dtype=np.float32).reshape(4, 6)
    buffer = transfer.upload(array, CUDA)
    np.testing.assert_array_equal(transfer.download(buffer.t()[1:, ::2]), array.T[1:, ::2])


def test_a_copy_larger_than_a_staging_buffer_goes_through_in_chunks(transfer, monkeypatch):
    monkeypatch.setattr(transfer, "STAGING_BYTES", 1 << 12)  # a 4 KiB buffer: the array takes ~10 chunks
    monkeypatch.setattr(transfer, "_pools", {})  # buffers of that size, dropped again after the test
    array = np.random.default_rng(0).standard_normal(5000).astype(np.float64)[::-1]
    np.testing.assert_array_equal(transfer.download(transfer.upload(array, CUDA)), array)


def test_statistics_count_transfers(transfer):
    before = dict(transfer.stats)
    buffer = transfer.upload(np.zeros((3, 4), dtype=np.float16), CUDA)
    transfer.download(buffer)
    assert transfer.stats["uploads"] == before["uploads"] + 1
    assert transfer.stats["bytes_uploaded"] == before["bytes_uploaded"] + 24
    assert transfer.stats["downloads"] == before["downloads"] + 1
    assert transfer.stats["bytes_downloaded"] == before["bytes_downloaded"] + 24


@pytest.mark.parametrize("dtype", DTYPES)
def test_tensors_reach_the_device_and_come_back_through_the_transfers(transfer, rng, dtype):
    array = random_array(rng, (4, 5), dtype)
    uploads = transfer.stats["uploads"]
    x = ember.tensor(array, device="cuda")
    assert transfer.stats["uploads"] == uploads + 1
    downloads = transfer.stats["downloads"]
    assert_identical(x.numpy(), array)
    assert transfer.stats["downloads"] == downloads + 1


def test_a_kernel_right_after_an_upload_sees_the_uploaded_data(rng):
    array = rng.standard_normal((64, 33)).astype(np.float32)
    x = ember.tensor(array, device="cuda")
    np.testing.assert_allclose((x * 2 + 1).sum(0).numpy(), (array * 2 + 1).sum(0), rtol=1e-5, atol=1e-5)


def test_copies_between_devices_go_through_the_transfers(transfer, rng):
    array = rng.standard_normal((3, 3)).astype(np.float32)
    before = dict(transfer.stats)
    back = (ember.tensor(array).to("cuda") * 3).to("cpu")
    np.testing.assert_allclose(back.numpy(), array * 3, rtol=1e-6)
    assert transfer.stats["uploads"] == before["uploads"] + 1
    assert transfer.stats["downloads"] == before["downloads"] + 1


# -- the DataLoader's prefetch ----------------------------------------------------------------------

def dataset(n: int = 23):
    rng = np.random.default_rng(7)
    return rng.standard_normal((n, 3)).astype(np.float32), rng.integers(0, 10, n), rng.random(n) < 0.5


def read(loader) -> list[tuple[np.ndarray, ...]]:
    return [tuple(t.numpy() for t in batch) for batch in loader]


def assert_same_batches(got, want) -> None:
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert len(g) == len(w)
        for field, (a, b) in enumerate(zip(g, w)):
            assert a.dtype == b.dtype, f"batch {i} field {field}"
            np.testing.assert_array_equal(a, b, err_msg=f"batch {i} field {field}")


@pytest.mark.parametrize("prefetch", [0, 1, 2])
@pytest.mark.parametrize("shuffle, drop_last", [(False, False), (True, False), (True, True)])
def test_a_cuda_loader_yields_the_cpu_loaders_batches_in_the_same_order(prefetch, shuffle, drop_last):
    data = dataset(23)
    cpu = DataLoader(data, batch_size=5, shuffle=shuffle, drop_last=drop_last, seed=3, device="cpu")
    gpu = DataLoader(data, batch_size=5, shuffle=shuffle, drop_last=drop_last, seed=3, device="cuda",
                     prefetch=prefetch)
    assert len(gpu) == len(cpu) == (4 if drop_last else 5)
    for _ in range(2):  # the second epoch draws the same new order on both
        want, got = read(cpu), read(gpu)
        assert_same_batches(got, want)
    if not drop_last:
        assert got[-1][0].shape == (3, 3)  # the last, partial batch


@pytest.mark.parametrize("prefetch", [0, 1])
def test_a_cuda_loader_yields_realized_device_tensors(prefetch):
    for batch in DataLoader(dataset(10), batch_size=4, device="cuda", prefetch=prefetch):
        for t in batch:
            assert t.device == CUDA
            assert t._node.op is Op.BUFFER and t._node.realized  # the upload is not part of the step's graph


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_a_cuda_loader_stays_prefetch_batches_ahead(transfer, prefetch):
    x, y, _ = dataset(20)
    loader = DataLoader((x, y), batch_size=4, device="cuda", prefetch=prefetch)
    uploads = transfer.stats["uploads"]
    batches = iter(loader)
    for i in range(len(loader)):
        next(batches)
        ahead = min(i + 1 + prefetch, len(loader))
        assert transfer.stats["uploads"] - uploads == 2 * ahead  # two fields a batch
    assert next(batches, None) is None


def test_an_error_in_a_prefetched_batch_is_raised_in_the_loop():
    class Broken(Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            if i == 5:
                raise IndexError("sample 5 is broken")
            return (np.zeros(3, np.float32),)

    with pytest.raises(IndexError, match="sample 5 is broken"):
        list(DataLoader(Broken(), batch_size=2, device="cuda", prefetch=1))


def test_prefetch_has_no_effect_on_the_cpu(transfer):
    uploads = transfer.stats["uploads"]
    loader = DataLoader(dataset(10), batch_size=4, device="cpu", prefetch=3)
    assert_same_batches(read(loader), read(DataLoader(dataset(10), batch_size=4, device="cpu", prefetch=0)))
    assert transfer.stats["uploads"] == uploads


def test_a_map_style_dataset_prefetches_to_the_device():
    class Squares(Dataset):
        def __len__(self) -> int:
            return 7

        def __getitem__(self, i: int):
            return np.full(2, i * i, dtype=np.int32), np.float32(i)

    cpu = read(DataLoader(Squares(), batch_size=3, device="cpu"))
    assert_same_batches(read(DataLoader(Squares(), batch_size=3, device="cuda")), cpu)


@pytest.mark.parametrize("prefetch", [-1, 1.5, "2"])
def test_invalid_prefetch_is_rejected(prefetch):
    with pytest.raises(ValueError, match="prefetch"):
        DataLoader(dataset(4), batch_size=2, device="cuda", prefetch=prefetch)
