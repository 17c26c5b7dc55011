"""One process of the distributed tests (tests/test_distributed.py), started by torchrun: runs a scenario on the
devices named and saves what it computed, per rank, for the test to check. Not collected by pytest."""

from __future__ import annotations

import contextlib
import os
import sys

import numpy as np

import ember
import ember.distributed as dist


def collectives(device: str) -> dict[str, np.ndarray]:
    """Each collective once, on values that differ by rank (and a half-precision sum)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    rng = np.random.default_rng(100 + rank)
    out = {}
    with ember.device(device):
        for op in ("sum", "avg", "max", "min", "product"):
            t = ember.tensor(rng.standard_normal((3, 5)).astype(np.float32))
            out[f"input_{op}"] = t.numpy()
            dist.all_reduce(t, op=op)
            out[f"all_reduce_{op}"] = t.numpy()
        h = ember.tensor(rng.standard_normal(7).astype(np.float32)).to(ember.bfloat16)
        out["input_bf16"] = h.float().numpy()
        dist.all_reduce(h)
        out["all_reduce_bf16"] = h.float().numpy()
        i = ember.tensor(np.arange(4, dtype=np.int64) * (rank + 1))
        dist.all_reduce(i)
        out["all_reduce_int"] = i.numpy()
        b = ember.tensor(np.full((2, 2), float(rank), dtype=np.float32))
        dist.broadcast(b, src=world - 1)
        out["broadcast"] = b.numpy()
        g = ember.tensor(np.full((2, 3), float(rank), dtype=np.float32)) + ember.arange(3)
        gathered = ember.zeros(2 * world, 3)
        dist.all_gather_into_tensor(gathered, g)
        out["all_gather_into_tensor"] = gathered.numpy()
        parts = [ember.zeros(2, 3) for _ in range(world)]
        dist.all_gather(parts, g * 2)
        out["all_gather"] = np.stack([p.numpy() for p in parts])
        s = ember.tensor(rng.standard_normal((2 * world, 3)).astype(np.float32))
        out["input_scatter"] = s.numpy()
        mine = ember.zeros(2, 3)
        dist.reduce_scatter_tensor(mine, s)
        out["reduce_scatter_tensor"] = mine.numpy()
        listed = ember.zeros(4)
        dist.reduce_scatter(listed, [ember.full((4,), float(rank + k)) for k in range(world)])
        out["reduce_scatter"] = listed.numpy()
        lazy = ember.tensor(np.ones(3, dtype=np.float32)) * (rank + 1)  # a pending graph in front of it
        dist.all_reduce(lazy)
        out["lazy_input"] = (lazy * 2).numpy()
    return out


def model(seed: int):
    ember.manual_seed(seed)
    return ember.nn.Sequential(ember.nn.Linear(6, 8), ember.nn.BatchNorm1d(8), ember.nn.ReLU(), ember.nn.Linear(8, 3))


def batches(step: int) -> tuple[np.ndarray, np.ndarray]:
    """The whole batch of a step (every rank's shard, in rank order), the same in every process."""
    rng = np.random.default_rng(1000 + step)
    return rng.standard_normal((8, 6)).astype(np.float32), rng.integers(0, 3, 8)


def ddp(device: str) -> dict[str, np.ndarray]:
    """Three SGD steps of a model wrapped in DistributedDataParallel (each rank initialised differently; buckets of
    one parameter or so), then a step accumulated over two micro-batches with no_sync on the first. Each rank
    trains on its shard of the batch."""
    rank, world = dist.get_rank(), dist.get_world_size()
    with ember.device(device):
        net = ember.nn.parallel.DistributedDataParallel(model(rank), bucket_cap_mb=1e-4)
        out = {f"initial.{k}": v.numpy() for k, v in net.module.state_dict().items()}
        opt = ember.optim.SGD(net.parameters(), lr=0.1)
        share = 8 // world
        for step in range(3):
            x, y = batches(step)
            mine = slice(rank * share, (rank + 1) * share)
            loss = ember.nn.functional.cross_entropy(net(ember.tensor(x[mine])), ember.tensor(y[mine]))
            opt.zero_grad()
            loss.backward()
            opt.step()
        opt.zero_grad()
        for micro, step in enumerate((3, 4)):
            x, y = batches(step)
            mine = slice(rank * share, (rank + 1) * share)
            context = net.no_sync() if micro == 0 else contextlib.nullcontext()
            with context:
                loss = ember.nn.functional.cross_entropy(net(ember.tensor(x[mine])), ember.tensor(y[mine]))
                loss.backward()
            out[f"grad_after_micro{micro}"] = net.module[0].weight.grad.numpy()
        opt.step()
        out.update({f"final.{k}": v.numpy() for k, v in net.state_dict().items()})
        net.module[1].momentum = 0.0  # the next forward keeps the running statistics it starts from: rank 0's
        net(ember.tensor(batches(5)[0][:share]))
        out["synced.running_mean"] = net.module[1].running_mean.numpy()
        out["synced.running_var"] = net.module[1].running_var.numpy()
    return out


def uneven_data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(5)
    return rng.standard_normal((11, 6)).astype(np.float32), rng.integers(0, 3, 11)


def plain_model(seed: int):
    ember.manual_seed(seed)
    return ember.nn.Sequential(ember.nn.Linear(6, 8), ember.nn.Tanh(), ember.nn.Linear(8, 3))


def uneven(device: str) -> dict[str, np.ndarray]:
    """An epoch of 11 samples over the processes (a DistributedSampler pads each share to 6) in batches of 4: a
    full batch, then a short one, in every process."""
    with ember.device(device):
        net = ember.nn.parallel.DistributedDataParallel(plain_model(dist.get_rank()))
        opt = ember.optim.SGD(net.parameters(), lr=0.2)
        data = ember.data.TensorDataset(*uneven_data())
        sampler = ember.data.DistributedSampler(data, shuffle=False)
        sizes = []
        for x, y in ember.data.DataLoader(data, batch_size=4, sampler=sampler, device=device):
            sizes.append(x.shape[0])
            opt.zero_grad()
            ember.nn.functional.cross_entropy(net(x), y).backward()
            opt.step()
        return {"sizes": np.array(sizes), **{k: v.numpy() for k, v in net.module.state_dict().items()}}


def jitted(device: str) -> dict[str, np.ndarray]:
    """DistributedDataParallel inside an ember.jit step: the replays run the bucket all-reduces too."""
    rank = dist.get_rank()
    with ember.device(device):
        net = ember.nn.parallel.DistributedDataParallel(plain_model(rank), bucket_cap_mb=1e-4)
        opt = ember.optim.SGD(net.parameters(), lr=0.1)

        def step(x, y):
            loss = ember.nn.functional.cross_entropy(net(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            return loss

        run = ember.jit(step)
        rng = np.random.default_rng(rank)
        for _ in range(5):
            run(ember.tensor(rng.standard_normal((4, 6)).astype(np.float32)), ember.tensor(rng.integers(0, 3, 4)))
        return {"replays": np.array(run.stats["replays"]),
                **{k: v.numpy() for k, v in net.module.state_dict().items()}}


class TwoHeads(ember.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used, self.unused = ember.nn.Linear(4, 2), ember.nn.Linear(4, 2)

    def forward(self, x):
        return self.used(x)


def unused(device: str) -> dict[str, np.ndarray]:
    """A parameter that takes no part in the loss: averaged as zeros with find_unused_parameters, an error at the
    next forward without."""
    rank = dist.get_rank()
    out = {}
    with ember.device(device):
        for find in (True, False):
            ember.manual_seed(rank)
            net = ember.nn.parallel.DistributedDataParallel(TwoHeads(), find_unused_parameters=find)
            opt = ember.optim.SGD(net.parameters(), lr=0.1)
            try:
                for step in range(2):
                    x = ember.tensor(np.full((3, 4), rank + step + 1.0, dtype=np.float32))
                    opt.zero_grad()
                    net(x).square().mean().backward()
                    opt.step()
                out[f"find{find}.used"] = net.module.used.weight.numpy()
                out[f"find{find}.unused_grad"] = net.module.unused.weight.grad.numpy()  # None without the zeros
            except RuntimeError as error:
                out[f"find{find}.error"] = np.array(str(error))
    return out


def raises(device: str) -> dict[str, np.ndarray]:
    """Rank 1 fails before a collective that rank 0 waits in."""
    if dist.get_rank() == 1:
        raise ValueError("rank 1 gives up")
    t = ember.ones(3, device=device)
    dist.all_reduce(t)
    return {"t": t.numpy()}


def main() -> None:
    scenario, device, where = sys.argv[1], sys.argv[2], sys.argv[3]
    with ember.device(device):  # the backend follows the device: NCCL on a GPU, gloo on the cpu or interpreted
        dist.init_process_group(timeout=60)
    try:
        result = {"collectives": collectives, "ddp": ddp, "raises": raises, "unused": unused,
                  "uneven": uneven, "jit": jitted}[scenario](device)
        np.savez(os.path.join(where, f"{scenario}-{device}-{dist.get_rank()}.npz"), **result)
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
