"""ember.save / ember.load: state dicts through safetensors files."""

import numpy as np
import pytest

import ember
import ember.nn.functional as F
from ember import nn, optim
from ember.serialize import load, save


def model():
    return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 3))


def test_model_state_dict_round_trips_and_reproduces_outputs(tmp_path):
    a = model()
    a(ember.randn(8, 4))  # move the BatchNorm statistics away from their initial values
    a.eval()
    save(a.state_dict(), tmp_path / "model.safetensors")
    loaded = load(tmp_path / "model.safetensors")
    assert list(loaded) == list(a.state_dict())
    assert loaded["1.num_batches_tracked"].dtype is ember.int64 and loaded["1.num_batches_tracked"].item() == 1
    b = model()
    b.load_state_dict(loaded)
    b.eval()
    x = ember.randn(5, 4)
    np.testing.assert_array_equal(a(x).numpy(), b(x).numpy())


def test_bfloat16_and_other_dtypes_round_trip_bit_for_bit(tmp_path):
    values = np.random.default_rng(0).standard_normal((3, 5)).astype(np.float32)
    state = {
        "bf16": ember.tensor(values, dtype=ember.bfloat16),
        "f16": ember.tensor(values, dtype=ember.float16),
        "f64": ember.tensor(values, dtype=ember.float64),
        "i32": ember.tensor([1, -2, 3], dtype=ember.int32),
        "mask": ember.tensor([True, False]),
        "scalar": ember.tensor(2.5),
        "empty": ember.zeros(0, 4),
    }
    save(state, tmp_path / "t.safetensors")
    loaded = load(tmp_path / "t.safetensors")
    for key, t in state.items():
        assert loaded[key].dtype is t.dtype and loaded[key].shape == t.shape, key
        np.testing.assert_array_equal(loaded[key].numpy().tobytes(), t.numpy().tobytes(), err_msg=key)


def test_files_are_plain_safetensors_with_dotted_names(tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    pytest.importorskip("torch")
    a = model()
    save(a.state_dict(), tmp_path / "m.safetensors")
    tensors = safetensors_torch.load_file(str(tmp_path / "m.safetensors"))
    assert sorted(tensors) == sorted(a.state_dict())
    np.testing.assert_array_equal(tensors["0.weight"].numpy(), a[0].weight.numpy())


def test_nested_structure_with_int_keys_tuples_and_plain_values_is_rebuilt(tmp_path):
    obj = {"state": {0: {"step": 3, "buf": ember.ones(2)}}, "groups": [{"betas": (0.9, 0.999), "name": None,
                                                                         "flag": True, "params": [0, 1]}]}
    save(obj, tmp_path / "n.safetensors")
    loaded = load(tmp_path / "n.safetensors")
    assert loaded["groups"] == obj["groups"]
    assert list(loaded["state"]) == [0] and loaded["state"][0]["step"] == 3
    np.testing.assert_array_equal(loaded["state"][0]["buf"].numpy(), [1.0, 1.0])


def test_optimizer_state_round_trip_continues_the_same_trajectory(tmp_path):
    rng = np.random.default_rng(0)
    data = [(ember.tensor(rng.standard_normal((8, 4)).astype(np.float32)), ember.tensor(rng.integers(0, 3, 8)))
            for _ in range(6)]

    def run(net, opt, batches):
        for x, y in batches:
            loss = F.cross_entropy(net(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()

    ember.manual_seed(0)
    reference = model()
    ember.manual_seed(0)
    resumed = model()
    ref_opt = optim.Adam(reference.parameters(), lr=0.01, amsgrad=True)
    run(reference, ref_opt, data[:3])
    save({"model": reference.state_dict(), "optim": ref_opt.state_dict()}, tmp_path / "ckpt.safetensors")
    run(reference, ref_opt, data[3:])

    checkpoint = load(tmp_path / "ckpt.safetensors")
    resumed.load_state_dict(checkpoint["model"])
    opt = optim.Adam(resumed.parameters(), lr=0.5)
    opt.load_state_dict(checkpoint["optim"])
    assert opt.param_groups[0]["lr"] == 0.01 and opt.param_groups[0]["betas"] == (0.9, 0.999)
    run(resumed, opt, data[3:])
    for (name, p), q in zip(reference.state_dict().items(), resumed.state_dict().values()):
        np.testing.assert_array_equal(p.numpy(), q.numpy(), err_msg=name)


def test_saving_a_module_instead_of_its_state_dict_is_an_error(tmp_path):
    with pytest.raises(TypeError, match="state_dict"):
        save(model(), tmp_path / "x.safetensors")
    with pytest.raises(TypeError, match="cannot store"):
        save({"f": lambda: 0}, tmp_path / "x.safetensors")
