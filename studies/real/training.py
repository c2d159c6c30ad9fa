"""The MAP network of every seed: MLP 2x50 tanh, Adam with weight decay."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from .data import Split

__all__ = ["TrainConfig", "make_mlp", "train_map"]


@dataclass(frozen=True)
class TrainConfig:
    """MAP training settings (full-batch-free minibatch Adam, early stopping).

    ``weight_decay`` is Adam's (coupled L2) coefficient on the mean loss, i.e. a
    Gaussian prior of precision ``weight_decay * N_train`` on the sum loss.
    """

    width: int = 50
    depth: int = 2
    epochs: int = 1000
    batch_size: int = 128
    lr: float = 1e-3
    weight_decay: float = 1e-4
    patience: int = 100  # epochs without a better validation loss


def make_mlp(n_in: int, n_out: int, width: int = 50, depth: int = 2) -> nn.Sequential:
    """``depth`` tanh hidden layers of ``width`` units.

    Parameters
    ----------
    n_in, n_out : int
        Input features ``D`` and outputs ``C``.
    width, depth : int
        Hidden layer size and count.

    Returns
    -------
    torch.nn.Sequential

    """
    layers: list[nn.Module] = []
    for i in range(depth):
        layers += [nn.Linear(n_in if i == 0 else width, width), nn.Tanh()]
    layers.append(nn.Linear(width if depth else n_in, n_out))
    return nn.Sequential(*layers)


def _loss(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, task: str
) -> torch.Tensor:
    out = model(x)
    if task == "classification":
        return F.cross_entropy(out, y)
    return F.mse_loss(out, y)


def train_map(split: Split, seed: int, config: TrainConfig) -> nn.Sequential:
    """Train the MAP network; keep the weights of the best validation loss.

    Parameters
    ----------
    split : Split
        Standardised data.
    seed : int
        Seeds initialisation and minibatch order.
    config : TrainConfig
        Settings.

    Returns
    -------
    torch.nn.Sequential
        The trained network in ``eval()`` mode.

    """
    torch.manual_seed(seed)
    model = make_mlp(
        split.x_train.shape[1], split.n_outputs, config.width, config.depth
    )
    opt = torch.optim.Adam(
        model.parameters(), lr=config.lr, weight_decay=config.weight_decay
    )
    gen = torch.Generator().manual_seed(seed)
    n = split.x_train.shape[0]
    best, best_state, since = float("inf"), None, 0
    for _ in range(config.epochs):
        model.train()
        for idx in torch.randperm(n, generator=gen).split(config.batch_size):
            opt.zero_grad()
            _loss(model, split.x_train[idx], split.y_train[idx], split.task).backward()
            opt.step()
        model.eval()
        with torch.no_grad():
            val = float(_loss(model, split.x_val, split.y_val, split.task))
        if val < best:
            best, since = val, 0
            best_state = {k: v.clone() for k, v in model.state_dict().items()}
        else:
            since += 1
            if since >= config.patience:
                break
    if best_state is not None:
        model.load_state_dict(best_state)
    model.eval()
    return model
