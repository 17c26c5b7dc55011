"""Collectives in a plan: each bucket's all-reduce is launched as soon as its gradients exist, runs beside the
launches after it (on the communication stream, on a GPU), the first launch reading its result waits for it, and
its input keeps its memory until then. In one process, over a gloo group of one (tests/test_distributed.py runs
the same steps between processes)."""

from __future__ import annotations

import io

import numpy as np
import pytest
from conftest import ON_GPU
from test_distributed import free_port

import ember
import ember.distributed as dist
from ember.compiler import KernelKind
from ember.nn.parallel import DistributedDataParallel

pytestmark = [pytest.mark.usefixtures("cuda_backend"), *([pytest.mark.gpu] if ON_GPU else [])]


@pytest.fixture(scope="module", autouse=True)
def world_of_one():
    import torch.distributed

    torch.distributed.init_process_group("nccl" if ON_GPU else "gloo", init_method=f"tcp://localhost:{free_port()}",
                                         world_size=1, rank=0)
    yield
    torch.distributed.destroy_process_group()


def network(seed: int = 0):
    ember.manual_seed(seed)
    return ember.nn.Sequential(ember.nn.Linear(8, 32), ember.nn.ReLU(), ember.nn.Linear(32, 32), ember.nn.ReLU(),
                               ember.nn.Linear(32, 32), ember.nn.ReLU(), ember.nn.Linear(32, 5))


def batch(step: int):
    rng = np.random.default_rng(step)
    return (ember.tensor(rng.standard_normal((7, 8)).astype(np.float32)),
            ember.tensor(rng.integers(0, 5, 7)))


def train(model, steps: int, plans: list | None = None, momentum: float = 0.9):
    opt = ember.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
    for step in range(steps):
        x, y = batch(step)
        opt.zero_grad()
        loss = ember.nn.functional.cross_entropy(model(x), y)
        with ember.explain.capture() as captured:
            loss.backward()
            opt.step()
            for p in model.parameters():
                p.numpy()
        if plans is not None:
            plans += captured
    return model


def bucket_size_mb(layers: int) -> float:
    """A bucket cap that puts about `layers` layers' parameters in each bucket."""
    return 1.01 * 4 * (32 * 32 + 32) * layers / 2**20


def step_plan(bucket_mb: float):
    with ember.device("cuda"):
        ddp = DistributedDataParallel(network(), bucket_cap_mb=bucket_mb)
        plans = []
        train(ddp, 2, plans)
    (plan,) = [p for p in plans[1:] if any(k.kind is KernelKind.COLLECTIVE for k in p.kernels)]
    return plan


def positions(plan):
    """Launch positions of the collectives, and of the kernels each one's input comes from."""
    made = {id(o): p for p, k in enumerate(plan.kernels) for o in k.outputs}
    collectives = [p for p, k in enumerate(plan.kernels) if k.kind is KernelKind.COLLECTIVE]
    inputs = {p: max(made[id(r)] for r in plan.kernels[p].reads if id(r) in made) for p in collectives}
    return collectives, inputs


def test_each_bucket_is_reduced_as_soon_as_its_gradients_exist_and_the_update_waits_for_it():
    plan = step_plan(bucket_size_mb(1))
    collectives, inputs = positions(plan)
    assert len(collectives) >= 3
    matmuls = [p for p, k in enumerate(plan.kernels) if k.kind is KernelKind.MATMUL or k.core is not None]
    # the first bucket (the last layer's) is on its way before the backward's last GEMM is launched
    assert min(collectives) < max(matmuls)
    for p in collectives:  # right after what makes its input: the flattening, if any, came with it
        between = plan.kernels[inputs[p] + 1:p]
        assert all(k.kind is KernelKind.COLLECTIVE for k in between), [str(k.kind) for k in between]
    joins = plan.schedule.joins
    assert sorted(p for waits in joins.values() for p in waits) == collectives
    for join, waits in joins.items():
        assert all(p < join for p in waits)
        if join < len(plan.kernels):  # the first launch that reads any of them
            reads = {id(r) for r in plan.kernels[join].reads}
            assert any(id(o) in reads for p in waits for o in plan.kernels[p].outputs)
    text = io.StringIO()
    print(plan, file=text)
    assert "stream    communication, beside kernels" in text.getvalue()


def test_what_a_collective_sends_keeps_its_memory_until_the_launch_that_waits_for_it():
    plan = step_plan(bucket_size_mb(1))
    slots = plan.schedule.slots
    waits_at = {p: join for join, waits in plan.schedule.joins.items() for p in waits}
    for p, join in waits_at.items():
        sent = [r for r in plan.kernels[p].reads if id(r) in slots]
        for q in range(p + 1, min(join, len(plan.kernels))):
            for o in plan.kernels[q].outputs:
                if id(o) not in slots:
                    continue
                a, n = slots[id(o)]
                for r in sent:
                    b, m = slots[id(r)]
                    assert a + n <= b or b + m <= a, f"kernel {q} writes over what collective {p} sends"


@pytest.mark.parametrize("bucket_layers", [pytest.param(1, marks=pytest.mark.slow), 2,
                                           pytest.param(100, marks=pytest.mark.slow)])
def test_a_world_of_one_trains_as_the_module_alone(bucket_layers):
    steps = 6 if ON_GPU else 3  # on a GPU, enough for a steady step to replay as a CUDA graph
    with ember.device("cuda"):
        alone = train(network(), steps)
        ddp = train(DistributedDataParallel(network(), bucket_cap_mb=bucket_size_mb(bucket_layers)), steps)
        for (name, a), b in zip(alone.state_dict().items(), ddp.module.state_dict().values()):
            np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-5, atol=1e-6, err_msg=name)


def test_a_collective_whose_result_nothing_reads_is_waited_for_at_the_plans_end():
    with ember.device("cuda"):
        x = ember.randn(6, 3)
        y = dist.collective(x * 2, "all_reduce", dist.ReduceOp.AVG)
        with ember.explain.capture() as plans:
            values = y.numpy()
    np.testing.assert_allclose(values, x.numpy() * 2, rtol=1e-6)
    (plan,) = plans
    assert plan.schedule.joins == {len(plan.kernels): [len(plan.kernels) - 1]}
    assert "the plan's end waits for it" in str(plan)


def test_from_the_second_step_a_bucket_is_averaged_from_a_template_one_node_per_gradient():
    from ember.ir import Op

    with ember.device("cuda"):
        ddp = DistributedDataParallel(network(), bucket_cap_mb=bucket_size_mb(2))
        train(ddp, 1)
        x, y = batch(1)
        ember.nn.functional.cross_entropy(ddp(x), y).backward()
        grads = [p.grad._node for p in ddp.parameters()]
    assert ddp._templates and all(t is not None for t in ddp._templates.values())
    assert all(g.op is Op.TEMPLATE for g in grads), {g.op for g in grads}
