"""An LSTM language model whose cell is written out step by step instead of calling ``nn.LSTM``.

nn.LSTM would capture as one fused aten op; unrolled, every time step is a handful of small ops
(two matmuls, adds, sigmoids, tanh, muls). That many-small-ops graph is what op bulking and
backward mirroring are designed for, so the zoo keeps it explicit.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


class LSTMLayer(nn.Module):
    """One LSTM layer over a whole sequence: (N, T, input_size) -> (N, T, hidden)."""

    def __init__(self, input_size: int, hidden: int) -> None:
        super().__init__()
        self.hidden = hidden
        # Gate order i, f, g, o as in nn.LSTM; one bias (nn.LSTM's two add up to one anyway).
        self.weight_ih = nn.Parameter(torch.empty(4 * hidden, input_size))
        self.weight_hh = nn.Parameter(torch.empty(4 * hidden, hidden))
        self.bias = nn.Parameter(torch.empty(4 * hidden))
        bound = 1.0 / math.sqrt(hidden)
        for parameter in (self.weight_ih, self.weight_hh, self.bias):
            nn.init.uniform_(parameter, -bound, bound)

    def forward(self, x: Tensor) -> Tensor:
        batch_size, seq_len, _ = x.shape
        h = x.new_zeros(batch_size, self.hidden)
        c = x.new_zeros(batch_size, self.hidden)
        outputs = []
        # The time loop runs over a static length, so tracing unrolls it into plain ops.
        for t in range(seq_len):
            gates = x[:, t] @ self.weight_ih.t() + h @ self.weight_hh.t() + self.bias
            i, f, g, o = gates.chunk(4, dim=1)
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            h = torch.sigmoid(o) * torch.tanh(c)
            outputs.append(h)
        return torch.stack(outputs, dim=1)


class LSTMLanguageModel(nn.Module):
    """Embedding -> LSTM layers (dropout between) -> Linear decoder, tied to the embedding by default.

    Example:
        ```python
        model = tandem.models.lstm_lm(vocab_size=256, num_layers=2)   # an LSTMLanguageModel
        model.decoder.weight is model.embedding.weight              # True: tied
        ```
    """

    def __init__(
        self, vocab_size: int, embed_dim: int, hidden: int, num_layers: int, dropout: float, tie_weights: bool
    ) -> None:
        super().__init__()
        if min(vocab_size, embed_dim, hidden, num_layers) < 1:
            raise ValueError(
                f"lstm_lm: vocab_size={vocab_size}, embed_dim={embed_dim}, hidden={hidden}, "
                f"num_layers={num_layers} must all be positive"
            )
        if tie_weights and embed_dim != hidden:
            raise ValueError(
                f"lstm_lm: tie_weights=True needs embed_dim == hidden (got {embed_dim} and {hidden}); "
                "make them equal or pass tie_weights=False"
            )
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"lstm_lm: dropout={dropout} must lie in [0, 1)")
        self.embedding = nn.Embedding(vocab_size, embed_dim)
        nn.init.uniform_(self.embedding.weight, -0.1, 0.1)
        sizes = [embed_dim] + [hidden] * num_layers
        self.layers = nn.ModuleList(LSTMLayer(sizes[k], sizes[k + 1]) for k in range(num_layers))
        # Identity when off, so a dropout-free model captures a dropout-free graph.
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.decoder = nn.Linear(hidden, vocab_size)
        if tie_weights:
            # One Parameter shared by both modules (Press & Wolf 2017): fewer weights, better perplexity.
            self.decoder.weight = self.embedding.weight

    @property
    def blocks(self) -> list[nn.Module]:
        """The LSTM layers in forward order.

        Example:
            ```python
            len(tandem.models.lstm_lm(num_layers=3).blocks)   # 3
            ```
        """
        return list(self.layers)

    def forward(self, tokens: Tensor) -> Tensor:
        """tokens: LongTensor (N, T) -> logits (N, T, vocab_size).

        Example:
            ```python
            model = tandem.models.lstm_lm(vocab_size=256)
            model(torch.randint(256, (4, 16))).shape    # (4, 16, 256)
            ```
        """
        x = self.dropout(self.embedding(tokens))
        for layer in self.layers:
            x = self.dropout(layer(x))
        return self.decoder(x)


def lstm_lm(
    vocab_size: int = 1000,
    embed_dim: int = 128,
    hidden: int = 128,
    num_layers: int = 2,
    dropout: float = 0.0,
    tie_weights: bool = True,
) -> LSTMLanguageModel:
    """An LSTM language model with an explicit, unrolled cell (see the module docstring for why).

    Example:
        ```python
        model = tandem.models.lstm_lm(vocab_size=512, embed_dim=128, hidden=128)
        logits = model(tokens)           # tokens (N, T) int64 -> (N, T, 512)
        ```
    """
    return LSTMLanguageModel(vocab_size, embed_dim, hidden, num_layers, dropout, tie_weights)
