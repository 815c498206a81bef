"""The centralized references of a leaderboard: what one learner holding every client's training
rows reaches on the same features, so that a reader sees the ceiling.

- Logistic regression: the linear softmax classifier minimizing mean cross-entropy + (l2/2)‖W‖²
  (bias unpenalized), full-batch L-BFGS with a strong-Wolfe line search, at most 500 iterations
  in float32. That is not always the optimum: on Fashion-MNIST's features the loss at l2 = 1e-4
  is still falling after them (0.2023; below 0.2008 after 885 in float64), at l2 = 0.01 it is
  within 1e-4 of it; the hold-out and test accuracies moved by at most 0.08 point there.
- MLP: the gradient methods' own model (`workbench.methods.heads`, the same seed and width)
  trained by minibatch SGD on the pooled rows, one epoch standing for a round: at most the
  budget's rounds, stopped by the same rule on the pooled hold-outs.

Both train on exactly the rows the federated methods train on (the clients' shares less their
hold-outs) and are chosen on the same hold-outs; the test split is only scored.
"""
from __future__ import annotations

import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from workbench.data.population import Population
from workbench.methods.heads import build_model


def accuracy(model: nn.Module, features: Tensor, labels: Tensor, batch: int = 8192) -> float:
    with torch.no_grad():
        correct = sum(int((model(features[i:i + batch]).argmax(1) == labels[i:i + batch]).sum())
                      for i in range(0, len(labels), batch))
    return correct / max(len(labels), 1)


def holdout_of(data: Population) -> tuple[Tensor, Tensor]:
    """The hold-out rows every choice is made on (the scenario's data always has them)."""
    if data.holdout is None:
        raise ValueError("the centralized references are chosen on the hold-outs: give the data a val_fraction")
    return data.holdout.features.float(), data.holdout.labels


def logistic_regression(data: Population, l2: float, max_iter: int = 500) -> dict[str, Any]:
    """The centralized linear classifier at ridge `l2`: its hold-out and test accuracy."""
    x, y = data.train.features.float(), data.train.labels
    model = nn.Linear(x.shape[1], data.num_classes)
    nn.init.zeros_(model.weight), nn.init.zeros_(model.bias)  # a convex problem: start anywhere
    optimizer = torch.optim.LBFGS(model.parameters(), lr=1.0, max_iter=max_iter, history_size=20,
                                  tolerance_grad=1e-7, tolerance_change=1e-10, line_search_fn="strong_wolfe")

    def closure() -> Tensor:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y) + 0.5 * l2 * model.weight.square().sum()
        loss.backward()
        return loss

    start = time.perf_counter()
    optimizer.step(closure)
    fit_s = time.perf_counter() - start
    return {"holdout_acc": accuracy(model, *holdout_of(data)),
            "test_acc": accuracy(model, data.test.features.float(), data.test.labels), "rounds": 0,
            "fit_s": fit_s, "curve": []}


def pooled_mlp(data: Population, lr: float, hidden_dim: int, batch_size: int, seed: int, epochs: int, patience: int,
               min_delta: float) -> dict[str, Any]:
    """The gradient methods' MLP trained on the pooled rows by SGD at `lr`, epoch by epoch to the
    stopping rule on the pooled hold-outs (at most `epochs`): the last epoch's model is scored."""
    x, y = data.train.features.float(), data.train.labels
    model = build_model("mlp", (x.shape[1],), data.num_classes, hidden_dim=hidden_dim, seed=seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    order = torch.Generator().manual_seed(seed)
    curve, best, best_epoch, fit_s = [], -1.0, 0, 0.0
    for epoch in range(1, epochs + 1):
        start = time.perf_counter()
        for index in torch.randperm(len(y), generator=order).split(batch_size):
            optimizer.zero_grad()
            F.cross_entropy(model(x[index]), y[index]).backward()
            optimizer.step()
        fit_s += time.perf_counter() - start
        holdout = accuracy(model, *holdout_of(data))
        curve.append({"round": epoch, "test_acc": accuracy(model, data.test.features.float(), data.test.labels),
                      "holdout_acc": holdout})
        if holdout - min_delta > best:
            best, best_epoch = holdout, epoch
        if patience and epoch - best_epoch >= patience:
            break
    return {"holdout_acc": curve[-1]["holdout_acc"], "test_acc": curve[-1]["test_acc"], "rounds": len(curve),
            "fit_s": fit_s, "curve": curve}
