"""Language models of the CLI: GPT-2 and LLaMA shapes, and the presets ``shardopt plan`` knows."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["PRESETS", "GPT", "GPTBlock", "GPTConfig", "Llama", "LlamaConfig", "build_mlp_stack"]

# [Note: preset shapes]
# The presets reproduce the parameter lists of the published models, in their order:
# GPT-2 (token and position embeddings, per block ln_1, qkv, attention projection, ln_2, fc,
# projection, all with biases, then ln_f; the output head is tied to the token embedding) and
# LLaMA (untied head, RMSNorm weights, SwiGLU, no biases). Linear weights are stored as
# ``(out, in)`` where GPT-2's Conv1D stores ``(in, out)``: same sizes, same order. So
# gpt2-small has 124,439,808 parameters, gpt2-xl 1,557,611,200 and llama-7b 6,738,415,616.


@dataclass(frozen=True, slots=True)
class GPTConfig:
    """A GPT-2 shape: vocabulary, context length, width, depth and attention heads.

    ``qkv_bias=False`` drops the attention input bias (GPT-2 has one): the key part of it gets
    an exactly zero gradient (softmax ignores a constant added to a row of scores), computed as
    rounding noise that Adam scales up to the learning rate, so no two runs agree on it.
    """

    vocab: int
    length: int
    width: int
    depth: int
    heads: int
    qkv_bias: bool = True

    def __post_init__(self) -> None:
        for name in ("vocab", "length", "width", "depth", "heads"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"GPTConfig: expected {name} to be an int >= 1, got {value!r}")
        if self.width % self.heads:
            raise ValueError(
                f"GPTConfig: expected width divisible by heads, got {self.width} and {self.heads}"
            )


class GPTBlock(nn.Module):
    """A GPT-2 block: causal self-attention then a GELU MLP, each after a LayerNorm, residual.

    ``qkv_bias`` as in :class:`GPTConfig`. The parameters are created in GPT-2's order.

    Example:
        >>> GPTBlock(8, 2, qkv_bias=False)(torch.zeros(1, 3, 8)).shape
        torch.Size([1, 3, 8])
    """

    def __init__(self, width: int, heads: int, qkv_bias: bool) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width, bias=qkv_bias)
        self.attn_proj = nn.Linear(width, width)
        self.ln_2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.mlp_proj = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(width, dim=-1)
        q, k, v = (t.view(batch, length, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_proj(y.transpose(1, 2).reshape(batch, length, width))
        return x + self.mlp_proj(F.gelu(self.fc(self.ln_2(x))))


class GPT(nn.Module):
    """A GPT-2 style causal language model (see [Note: preset shapes]); returns logits.

    Example:
        >>> model = GPT(GPTConfig(vocab=10, length=8, width=16, depth=1, heads=2))
        >>> model(torch.zeros(2, 5, dtype=torch.long)).shape
        torch.Size([2, 5, 10])
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab, config.width)
        self.wpe = nn.Embedding(config.length, config.width)
        self.blocks = nn.ModuleList(
            GPTBlock(config.width, config.heads, config.qkv_bias) for _ in range(config.depth)
        )
        self.ln_f = nn.LayerNorm(config.width)
        for name, p in self.named_parameters():
            if name.endswith("weight") and p.dim() == 2:
                nn.init.normal_(p, std=0.02)
            elif name.endswith("bias") and "ln" not in name:
                nn.init.zeros_(p)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.wte(tokens) + self.wpe(positions)
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x) @ self.wte.weight.t()


@dataclass(frozen=True, slots=True)
class LlamaConfig:
    """A LLaMA shape: vocabulary, width, depth, heads and the SwiGLU hidden width."""

    vocab: int
    width: int
    depth: int
    heads: int
    hidden: int

    def __post_init__(self) -> None:
        for name in ("vocab", "width", "depth", "heads", "hidden"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"LlamaConfig: expected {name} to be an int >= 1, got {value!r}")
        if self.width % (2 * self.heads):
            raise ValueError(
                f"LlamaConfig: expected width divisible by 2 * heads, got {self.width} and "
                f"{self.heads}"
            )


def _rotate(x: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of ``(batch, heads, length, dim)`` queries or keys."""
    length, dim = x.shape[-2], x.shape[-1]
    freqs = 10000.0 ** (-torch.arange(0, dim, 2, device=x.device, dtype=torch.float32) / dim)
    angles = torch.arange(length, device=x.device, dtype=torch.float32)[:, None] * freqs
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], dim // 2, 2))
    return torch.view_as_real(pairs * torch.polar(torch.ones_like(angles), angles)).flatten(-2)


class _LlamaBlock(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        w, h = config.width, config.hidden
        self.heads = config.heads
        self.q, self.k, self.v, self.o = (nn.Linear(w, w, bias=False) for _ in range(4))
        self.gate, self.up = nn.Linear(w, h, bias=False), nn.Linear(w, h, bias=False)
        self.down = nn.Linear(h, w, bias=False)
        self.attn_norm, self.mlp_norm = nn.RMSNorm(w), nn.RMSNorm(w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        y = self.attn_norm(x)
        q, k, v = (
            f(y).view(batch, length, self.heads, -1).transpose(1, 2)
            for f in (self.q, self.k, self.v)
        )
        q, k = _rotate(q).to(v.dtype), _rotate(k).to(v.dtype)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(y.transpose(1, 2).reshape(batch, length, width))
        y = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(y)) * self.up(y))


class Llama(nn.Module):
    """A LLaMA style causal language model (see [Note: preset shapes]); returns logits.

    Example:
        >>> model = Llama(LlamaConfig(vocab=10, width=8, depth=1, heads=2, hidden=12))
        >>> model(torch.zeros(1, 3, dtype=torch.long)).shape
        torch.Size([1, 3, 10])
    """

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(config.vocab, config.width)
        self.blocks = nn.ModuleList(_LlamaBlock(config) for _ in range(config.depth))
        self.norm = nn.RMSNorm(config.width)
        self.head = nn.Linear(config.width, config.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class _MLPStack(nn.Module):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers[:-1]:
            x = F.relu(layer(x))
        return self.layers[-1](x)


def build_mlp_stack(width: int = 1024, depth: int = 12) -> nn.Module:
    """``depth`` ReLU layers of ``width x width`` (the benchmark MLP: 12 x 1024 by default).

    Example:
        >>> sum(p.numel() for p in build_mlp_stack(4, 3).parameters())
        60
    """
    if width < 1 or depth < 1:
        raise ValueError(f"build_mlp_stack: expected width, depth >= 1, got {width}, {depth}")
    return _MLPStack(width, depth)


def _gpt2(width: int, depth: int, heads: int) -> Callable[[], nn.Module]:
    return lambda: GPT(GPTConfig(50257, 1024, width, depth, heads))


PRESETS: dict[str, Callable[[], nn.Module]] = {
    "gpt2-small": _gpt2(768, 12, 12),
    "gpt2-medium": _gpt2(1024, 24, 16),
    "gpt2-large": _gpt2(1280, 36, 20),
    "gpt2-xl": _gpt2(1600, 48, 25),
    "llama-7b": lambda: Llama(LlamaConfig(32000, 4096, 32, 32, 11008)),
    "mlp-12x1024": build_mlp_stack,
}
"""Model factories by name; build them under ``torch.device("meta")`` to get shapes only."""
