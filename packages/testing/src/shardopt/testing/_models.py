"""Small reference models, each built deterministically from a seed."""

from __future__ import annotations

import itertools

import torch
from torch import nn

__all__ = [
    "build_conv_net",
    "build_frozen_mlp",
    "build_gated_mlp",
    "build_gpt",
    "build_mixed_dtype_mlp",
    "build_mlp",
]


def _build(seed: int, make: type[nn.Module], *args: object, dtype: torch.dtype) -> nn.Module:
    """``make(*args)`` with the global RNG seeded inside a fork: the caller's RNG is untouched."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        module = make(*args)
    return module.to(dtype)


class _MLP(nn.Module):
    def __init__(self, sizes: tuple[int, ...]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in itertools.pairwise(sizes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers[:-1]:
            x = torch.tanh(layer(x))
        return self.layers[-1](x)


def build_mlp(
    seed: int = 0, *, sizes: tuple[int, ...] = (8, 16, 16, 4), dtype: torch.dtype = torch.float32
) -> nn.Module:
    """A tanh MLP with layers ``sizes[0] -> ... -> sizes[-1]`` (``layers.<i>.weight/bias``).

    Example:
        >>> a, b = build_mlp(seed=3), build_mlp(seed=3)
        >>> all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
        True
    """
    return _build(seed, _MLP, sizes, dtype=dtype)


def build_frozen_mlp(seed: int = 0, *, dtype: torch.dtype = torch.float32) -> nn.Module:
    """``build_mlp`` with its first layer frozen (``requires_grad=False``).

    Example:
        >>> [p.requires_grad for p in build_frozen_mlp().parameters()][:3]
        [False, False, True]
    """
    model = build_mlp(seed, dtype=dtype)
    model.layers[0].requires_grad_(False)  # type: ignore[index]
    return model


class _ConvNet(nn.Module):
    def __init__(self, channels: int, classes: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, 4, 3, padding=1)
        self.conv2 = nn.Conv2d(4, 8, 3, stride=2, padding=1)
        self.norm = nn.GroupNorm(2, 8)
        self.head = nn.Linear(8, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.conv1(x))
        x = torch.tanh(self.norm(self.conv2(x)))
        return self.head(x.mean(dim=(2, 3)))


def build_conv_net(
    seed: int = 0, *, channels: int = 3, classes: int = 10, dtype: torch.dtype = torch.float32
) -> nn.Module:
    """Two convolutions, a GroupNorm (no batch statistics) and a linear head.

    Example:
        >>> build_conv_net()(torch.zeros(2, 3, 8, 8)).shape
        torch.Size([2, 10])
    """
    return _build(seed, _ConvNet, channels, classes, dtype=dtype)


class _GPT(nn.Module):
    def __init__(self, vocab: int, width: int, depth: int, length: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(0.02 * torch.randn(length, width))
        # torch's own pre-norm block, without biases: the attention input bias's key part has an
        # exactly zero gradient, computed as rounding noise that no two summation orders agree on.
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(
                width,
                2,
                4 * width,
                dropout=0.0,
                activation="gelu",
                batch_first=True,
                norm_first=True,
                bias=False,
            )
            for _ in range(depth)
        )
        self.norm = nn.LayerNorm(width)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.position[: tokens.shape[1]]
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1], dtype=x.dtype)
        for block in self.blocks:
            x = block(x, src_mask=mask, is_causal=True)
        return self.norm(x) @ self.embed.weight.t()  # the output head is tied to the embedding


def build_gpt(
    seed: int = 0,
    *,
    vocab: int = 1024,
    width: int = 16,
    depth: int = 2,
    length: int = 8,
    dtype: torch.dtype = torch.float32,
) -> nn.Module:
    """A GPT-style stack of causal attention blocks whose (tied) embedding dominates.

    With the defaults the embedding holds about 70% of the parameters: the imbalance case for
    optimizers that shard by whole parameters.

    Example:
        >>> model = build_gpt()
        >>> model.embed.weight.numel() > sum(p.numel() for p in model.parameters()) / 2
        True
    """
    return _build(seed, _GPT, vocab, width, depth, length, dtype=dtype)


class _MixedDtypeMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 16)
        self.middle = nn.Linear(16, 16).to(torch.bfloat16)
        self.last = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.first(x))
        h = torch.tanh(self.middle(h.to(torch.bfloat16))).to(x.dtype)
        return self.last(h)


def build_mixed_dtype_mlp(seed: int = 0) -> nn.Module:
    """An MLP whose middle layer is bfloat16 and the others float32.

    Example:
        >>> sorted({str(p.dtype) for p in build_mixed_dtype_mlp().parameters()})
        ['torch.bfloat16', 'torch.float32']
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return _MixedDtypeMLP()


class _GatedMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.hidden = nn.Linear(8, 16)
        self.out = nn.Linear(16, 4)
        self.extra = nn.Linear(16, 4)  # used only when the batch's gate is on

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.hidden(x))
        y = self.out(h)
        if bool(gate[0] > 0):
            y = y + self.extra(h)
        return y


def build_gated_mlp(seed: int = 0, *, dtype: torch.dtype = torch.float32) -> nn.Module:
    """An MLP whose ``extra`` layer gets no gradient in steps whose batch has the gate off.

    Called as ``model(x, gate)``; every row of ``gate`` holds the same 0/1 value, so all ranks
    agree on whether ``extra`` is used.

    Example:
        >>> model = build_gated_mlp()
        >>> model(torch.zeros(2, 8), torch.zeros(2)).sum().backward()
        >>> model.extra.weight.grad is None
        True
    """
    return _build(seed, _GatedMLP, dtype=dtype)
