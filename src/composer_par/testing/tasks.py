"""Small training tasks for parity tests (see :mod:`composer_par.testing.parity`).

Each task is a module-level object, so rank processes import it by name.
"""

from __future__ import annotations

from typing import Any

import attrs


@attrs.frozen
class LlamaTask:
    """Next-token prediction with the small Llama of :mod:`composer_par.models.llama`."""

    n_layers: int = 2
    dim: int = 64
    n_heads: int = 4
    n_kv_heads: int = 2
    vocab_size: int = 256
    global_batch: int = 8
    seq_len: int = 16
    data_seed: int = 1234

    def config(self) -> Any:
        from composer_par.models.llama import LlamaConfig

        return LlamaConfig(
            vocab_size=self.vocab_size,
            dim=self.dim,
            n_layers=self.n_layers,
            n_heads=self.n_heads,
            n_kv_heads=self.n_kv_heads,
            ffn_hidden=2 * self.dim,
            max_seq_len=self.seq_len,
        )

    def build(self) -> Any:
        from composer_par.models.llama import Llama

        return Llama(self.config())

    def batch(self, step: int) -> Any:
        """Arithmetic sequences modulo the vocabulary: learnable, so losses fall."""
        import torch

        gen = torch.Generator().manual_seed(self.data_seed + step)
        start = torch.randint(0, self.vocab_size, (self.global_batch, 1), generator=gen)
        stride = torch.randint(1, 4, (self.global_batch, 1), generator=gen)
        return (start + stride * torch.arange(self.seq_len)) % self.vocab_size

    def loss(self, model: Any, batch: Any) -> Any:
        from composer_par.models.llama import next_token_loss

        return next_token_loss(model(batch), batch)


@attrs.frozen
class MLPTask:
    """Regression with a stack of Linear+Tanh blocks (a non-transformer model)."""

    width: int = 32
    depth: int = 4
    global_batch: int = 16
    data_seed: int = 99

    def build(self) -> Any:
        import torch.nn as nn

        blocks = [
            nn.Sequential(nn.Linear(self.width, self.width), nn.Tanh()) for _ in range(self.depth)
        ]
        return nn.Sequential(*blocks, nn.Linear(self.width, 1))

    def batch(self, step: int) -> Any:
        """Inputs and the outputs of a fixed random teacher: learnable, so losses fall."""
        import torch

        gen = torch.Generator().manual_seed(self.data_seed + step)
        inputs = torch.randn(self.global_batch, self.width, generator=gen)
        teacher = torch.randn(self.width, 1, generator=torch.Generator().manual_seed(0))
        return torch.cat([inputs, torch.tanh(inputs @ teacher / self.width**0.5)], dim=1)

    def loss(self, model: Any, batch: Any) -> Any:
        inputs, target = batch[:, :-1], batch[:, -1:]
        return ((model(inputs) - target) ** 2).mean()


@attrs.frozen
class EncoderTask:
    """Sequence regression with ``torch.nn.TransformerEncoder`` (batch_first, pre-norm).

    The model is ``Sequential(Linear, TransformerEncoder, LayerNorm, Linear)``: only torch
    modules, so MetaInit initializes it through their own ``reset_parameters`` /
    ``_reset_parameters`` (``nn.MultiheadAttention``). Dropout is 0 so ranks and the
    reference compute the same thing. Each token's target mixes its own input with the
    sequence mean, so attention has something to learn.
    """

    width: int = 32
    n_layers: int = 2
    n_heads: int = 4
    seq_len: int = 8
    global_batch: int = 8
    data_seed: int = 7

    def build(self) -> Any:
        import torch.nn as nn

        layer = nn.TransformerEncoderLayer(
            self.width, self.n_heads, dim_feedforward=2 * self.width, dropout=0.0,
            activation="gelu", batch_first=True, norm_first=True,
        )
        return nn.Sequential(
            nn.Linear(self.width, self.width),
            nn.TransformerEncoder(layer, self.n_layers, enable_nested_tensor=False),
            nn.LayerNorm(self.width),
            nn.Linear(self.width, 1),
        )

    def batch(self, step: int) -> Any:
        import torch

        gen = torch.Generator().manual_seed(self.data_seed + step)
        inputs = torch.randn(self.global_batch, self.seq_len, self.width, generator=gen)
        teacher = torch.randn(self.width, 1, generator=torch.Generator().manual_seed(1))
        mixed = inputs + inputs.mean(dim=1, keepdim=True)
        target = torch.tanh(mixed @ teacher / self.width**0.5)
        return torch.cat([inputs, target], dim=-1)

    def loss(self, model: Any, batch: Any) -> Any:
        inputs, target = batch[..., :-1], batch[..., -1:]
        return ((model(inputs) - target) ** 2).mean()


llama = LlamaTask()
mlp = MLPTask()
encoder = EncoderTask()
