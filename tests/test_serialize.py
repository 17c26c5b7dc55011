"""ember.save / ember.load: state dicts through safetensors files."""

import io

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


def _state():
    rng = np.random.default_rng(1)
    return {"w": ember.tensor(rng.standard_normal((3, 4)).astype(np.float32)),
            "h": ember.tensor(rng.standard_normal(5).astype(np.float32), dtype=ember.bfloat16), "step": 7}


def _assert_same_state(loaded, state):
    assert loaded["step"] == state["step"]
    for key in ("w", "h"):
        assert loaded[key].dtype is state[key].dtype
        np.testing.assert_array_equal(loaded[key].numpy().tobytes(), state[key].numpy().tobytes())


def test_save_and_load_take_a_bytesio_as_torch_save_and_load_do():
    state = _state()
    buffer = io.BytesIO()
    save(state, buffer)
    buffer.seek(0)
    _assert_same_state(load(buffer), state)


def test_save_and_load_take_open_binary_files_and_pathlib_paths(tmp_path):
    state = _state()
    with open(tmp_path / "a.safetensors", "wb") as f:
        save(state, f)
    _assert_same_state(load(tmp_path / "a.safetensors"), state)
    _assert_same_state(load(str(tmp_path / "a.safetensors")), state)
    with open(tmp_path / "a.safetensors", "rb") as f:
        _assert_same_state(load(f), state)


def test_a_file_object_written_by_save_is_the_same_safetensors_as_a_path(tmp_path):
    state = _state()
    buffer = io.BytesIO()
    save(state, buffer)
    save(state, tmp_path / "a.safetensors")
    assert buffer.getvalue() == (tmp_path / "a.safetensors").read_bytes()


def test_text_mode_files_are_refused_with_the_mode_to_use(tmp_path):
    with open(tmp_path / "t", "w") as f, pytest.raises(TypeError, match=r"binary mode \('wb'\)"):
        save(_state(), f)
    (tmp_path / "t").write_text("text")
    with open(tmp_path / "t") as f, pytest.raises(TypeError, match=r"binary mode \('rb'\)"):
        load(f)


def test_a_file_written_by_torch_save_is_refused_naming_the_file_and_the_way_to_convert_it(tmp_path):
    torch = pytest.importorskip("torch")
    torch.save({"w": torch.randn(2, 3)}, tmp_path / "model.pt")
    with pytest.raises(ValueError) as info:
        load(tmp_path / "model.pt")
    message = str(info.value)
    for fragment in ["model.pt", "not a safetensors file", "torch.save", "torch.load", "ember.tensor",
                     "ember.from_torch"]:
        assert fragment in message, (fragment, message)
    buffer = io.BytesIO()
    torch.save({"w": torch.randn(2, 3)}, buffer)
    buffer.seek(0)
    with pytest.raises(ValueError, match="BytesIO object is not a safetensors file: .*torch.save"):
        load(buffer)


def test_a_legacy_pickle_from_torch_save_is_refused_as_one(tmp_path):
    torch = pytest.importorskip("torch")
    torch.save({"w": torch.randn(2)}, tmp_path / "old.pt", _use_new_zipfile_serialization=False)
    with pytest.raises(ValueError, match=r"old\.pt' is not a safetensors file: it is a pickle .*torch\.load"):
        load(tmp_path / "old.pt")


def _truncated(tmp_path):
    save(_state(), tmp_path / "whole.safetensors")
    return (tmp_path / "whole.safetensors").read_bytes()[:-5]


@pytest.mark.parametrize("contents, what", [
    (lambda tmp_path: b"", "it is empty"),
    (lambda tmp_path: b"a text file, not tensors\n" * 4, "it does not start with a safetensors header"),
    (lambda tmp_path: np.random.default_rng(2).bytes(200), "it does not start with a safetensors header"),
    (_truncated, "it starts as one but is cut short or corrupt"),
], ids=["empty", "text", "random_bytes", "truncated"])
def test_a_file_that_is_not_safetensors_is_refused_naming_it(tmp_path, contents, what):
    (tmp_path / "bad.bin").write_bytes(contents(tmp_path))
    with pytest.raises(ValueError, match=f"^load: '.*bad.bin' is not a safetensors file: {what}"):
        load(tmp_path / "bad.bin")


@pytest.mark.parametrize("structure", ['{"dict": [["a", {"tensor": "a"}]', '["not", "a", "node"]',
                                       '{"tensor": "missing"}'])
def test_a_file_with_corrupt_structure_metadata_is_refused_naming_it(tmp_path, structure):
    import safetensors.numpy

    path = tmp_path / "state.safetensors"
    safetensors.numpy.save_file({"a": np.arange(3, dtype=np.float32)}, str(path),
                                metadata={"ember.structure": structure})
    with pytest.raises(ValueError, match=r"load: .*state\.safetensors.* corrupt 'ember.structure'"):
        ember.load(path)
