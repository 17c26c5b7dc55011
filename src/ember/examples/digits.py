"""Train an MLP on scikit-learn's bundled 8x8 digits (no download) and report test accuracy.

    python -m ember.examples.digits [--epochs 30] [--batch-size 64] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

import ember
import ember.nn as nn
import ember.nn.functional as F
from ember.data import DataLoader
from ember.examples import default_device


def load_digits_split(seed: int = 0, test_fraction: float = 0.2):
    """Standardised features and labels, split into train and test sets."""
    from sklearn.datasets import load_digits  # an optional package, loaded only for this example's data

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(x))
    n_test = int(len(x) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    mean, std = x[train].mean(0), x[train].std(0) + 1e-6
    x = (x - mean) / std
    return (x[train], y[train]), (x[test], y[test])


def make_model(hidden: int = 128) -> nn.Module:
    return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, 10))


@dataclass
class Summary:
    accuracy: float
    seconds: float
    steps: int
    final_loss: float
    step_plan: object = None  # the fused plan of one training step (forward, backward, update)

    def __str__(self) -> str:
        plan = self.step_plan
        kernels = (f"  |  one step = {len(plan.kernels)} fused kernels ({plan.launches} launches) "
                   f"for {plan.unfused} ops") if plan is not None else ""
        return (f"test accuracy {self.accuracy:.2%}  |  {self.steps} steps in {self.seconds:.1f} s "
                f"({self.steps / self.seconds:.0f} steps/s)  |  final loss {self.final_loss:.4f}{kernels}")


def evaluate(model: nn.Module, x: np.ndarray, y: np.ndarray, device) -> float:
    model.eval()
    with ember.no_grad():
        logits = model(ember.tensor(x, device=device))
        predicted = logits.argmax(dim=1).numpy()
    model.train()
    return float((predicted == y).mean())


def train(epochs: int = 30, batch_size: int = 64, lr: float = 1e-3, hidden: int = 128, device: str = "cpu",
          seed: int = 0, progress: bool = True, explain: bool = False) -> Summary:
    ember.manual_seed(seed)
    (x_train, y_train), (x_test, y_test) = load_digits_split(seed)
    with ember.device(device):
        model = make_model(hidden)
    optimizer = ember.optim.Adam(model.parameters(), lr=lr)
    loader = DataLoader((x_train, y_train), batch_size=batch_size, shuffle=True, seed=seed, device=device)
    steps, loss_value, step_plan = 0, float("nan"), None
    start = time.perf_counter()
    bar = tqdm(total=epochs * len(loader), disable=not progress, unit="step", desc="digits")
    for _ in range(epochs):
        for xb, yb in loader:
            loss = F.cross_entropy(model(xb), yb)
            optimizer.zero_grad()
            loss.backward()
            if steps == len(loader):  # a steady-state step: plan what it computes
                with ember.explain.capture() as plans:
                    optimizer.step()
                step_plan = plans[0]
                if explain:
                    tqdm.write(str(step_plan))
            else:
                optimizer.step()  # realizes forward, backward and update together
            steps += 1
            if steps % 20 == 0:
                loss_value = loss.item()
                bar.set_postfix(loss=f"{loss_value:.4f}")
            bar.update()
    bar.close()
    loss_value = loss.item()
    seconds = time.perf_counter() - start
    return Summary(evaluate(model, x_test, y_test, device), seconds, steps, loss_value, step_plan)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--device", default=default_device(), help="default: cuda where a GPU is usable, else cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--explain", action="store_true", help="print the fused plan of one training step")
    args = parser.parse_args(argv)
    summary = train(args.epochs, args.batch_size, args.lr, args.hidden, args.device, args.seed,
                    explain=args.explain)
    print(summary)


if __name__ == "__main__":
    main()
