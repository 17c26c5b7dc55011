"""ember.data: batching, shuffling, drop_last and determinism of the DataLoader."""

import numpy as np
import pytest

import ember
from ember.data import DataLoader, Dataset, TensorDataset


def arrays(n=10):
    x = np.arange(n * 3, dtype=np.float32).reshape(n, 3)
    y = np.arange(n, dtype=np.int64) * 10
    return x, y


def test_batches_cover_the_data_in_order_with_a_smaller_last_batch():
    x, y = arrays(10)
    loader = DataLoader(TensorDataset(ember.tensor(x), ember.tensor(y)), batch_size=4)
    assert len(loader) == 3
    batches = list(loader)
    assert [b[0].shape for b in batches] == [(4, 3), (4, 3), (2, 3)]
    assert all(isinstance(t, ember.Tensor) for b in batches for t in b)
    np.testing.assert_array_equal(np.concatenate([b[0].numpy() for b in batches]), x)
    np.testing.assert_array_equal(np.concatenate([b[1].numpy() for b in batches]), y)
    assert batches[0][0].dtype is ember.float32 and batches[0][1].dtype is ember.int64


def test_drop_last_drops_the_incomplete_batch():
    loader = DataLoader(arrays(10), batch_size=4, drop_last=True)
    assert len(loader) == 2
    assert [b[0].shape[0] for b in loader] == [4, 4]


def test_shuffle_permutes_rows_consistently_across_arrays_and_reshuffles_every_epoch():
    x, y = arrays(20)
    loader = DataLoader((x, y), batch_size=5, shuffle=True, seed=0)
    epochs = []
    for _ in range(2):
        xs, ys = zip(*[(bx.numpy(), by.numpy()) for bx, by in loader])
        xs, ys = np.concatenate(xs), np.concatenate(ys)
        np.testing.assert_array_equal(xs[:, 0] / 3 * 10, ys)  # rows stay paired
        assert sorted(ys.tolist()) == y.tolist()
        epochs.append(ys)
    assert not np.array_equal(epochs[0], y) and not np.array_equal(epochs[0], epochs[1])


def test_the_same_seed_gives_the_same_sequence_of_epochs():
    def orders(seed):
        loader = DataLoader(arrays(12), batch_size=4, shuffle=True, seed=seed)
        return [np.concatenate([b[1].numpy() for b in loader]).tolist() for _ in range(3)]

    assert orders(7) == orders(7)
    assert orders(7) != orders(8)


def test_numpy_arrays_and_a_single_array_are_accepted():
    x, _ = arrays(5)
    (batch,) = next(iter(DataLoader(x, batch_size=5)))
    np.testing.assert_array_equal(batch.numpy(), x)
    x64 = x.astype(np.float64)
    assert next(iter(DataLoader((x64,), batch_size=2)))[0].dtype is ember.float64


def test_batches_are_placed_on_the_requested_device():
    (batch,) = next(iter(DataLoader(arrays(4)[0], batch_size=2, device="cpu")))
    assert batch.device == ember.device("cpu").device


def test_map_style_datasets_are_stacked_per_field():
    class Squares(Dataset):
        def __len__(self):
            return 6

        def __getitem__(self, i):
            return np.full(2, i, np.float32), np.int64(i * i)

    batches = list(DataLoader(Squares(), batch_size=4))
    np.testing.assert_array_equal(batches[1][0].numpy(), [[4, 4], [5, 5]])
    np.testing.assert_array_equal(batches[0][1].numpy(), [0, 1, 4, 9])


def test_tensor_dataset_indexes_rows_and_checks_lengths():
    x, y = arrays(4)
    ds = TensorDataset(x, y)
    assert len(ds) == 4
    row_x, row_y = ds[2]
    np.testing.assert_array_equal(row_x.numpy(), x[2])
    assert row_y.item() == 20
    with pytest.raises(ember.ShapeError, match=r"\(4, 3\), \(3,\)"):
        TensorDataset(x, y[:3])


def test_invalid_batch_size_is_rejected():
    with pytest.raises(ValueError, match="batch_size"):
        DataLoader(arrays(4), batch_size=0)
