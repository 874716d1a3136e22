"""A small decoder-only transformer in the style of nanoGPT (Karpathy), read top to bottom.

Attention is spelled out as matmul + masked softmax rather than ``scaled_dot_product_attention``,
so the captured graph holds plain aten ops that tandem's passes can see into.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.nn import functional as F


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position t attends only to positions <= t."""

    causal_mask: Tensor

    def __init__(self, n_embd: int, n_head: int, block_size: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.attn_dropout = nn.Dropout(dropout)
        self.resid_dropout = nn.Dropout(dropout)
        # A bool buffer: .double() leaves it alone and it is not a parameter.
        causal = torch.tril(torch.ones(block_size, block_size, dtype=torch.bool))
        self.register_buffer("causal_mask", causal.view(1, 1, block_size, block_size), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        batch_size, seq_len, n_embd = x.shape
        head_dim = n_embd // self.n_head
        q, k, v = self.c_attn(x).split(n_embd, dim=2)
        # (N, T, C) -> (N, heads, T, head_dim)
        q, k, v = (t.view(batch_size, seq_len, self.n_head, head_dim).transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(head_dim))
        mask = self.causal_mask[:, :, :seq_len, :seq_len]
        weights = self.attn_dropout(F.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1))
        y = (weights @ v).transpose(1, 2).reshape(batch_size, seq_len, n_embd)
        return self.resid_dropout(self.c_proj(y))


class FeedForward(nn.Module):
    def __init__(self, n_embd: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * n_embd, n_embd, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, n_embd: int, n_head: int, block_size: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention(n_embd, n_head, block_size, dropout, bias)
        self.ln_2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = FeedForward(n_embd, dropout, bias)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Token + position embeddings -> blocks -> LayerNorm -> lm_head (tied to the token embedding).

    Example:
        ```python
        model = tandem.models.gpt(vocab_size=256, block_size=64, n_layer=2)   # a GPT
        logits = model(torch.randint(256, (4, 64)))                          # (4, 64, 256)
        ```
    """

    def __init__(
        self,
        vocab_size: int,
        block_size: int,
        n_layer: int,
        n_head: int,
        n_embd: int,
        dropout: float,
        bias: bool,
    ) -> None:
        super().__init__()
        if min(vocab_size, block_size, n_layer, n_head, n_embd) < 1:
            raise ValueError(
                f"gpt: vocab_size={vocab_size}, block_size={block_size}, n_layer={n_layer}, "
                f"n_head={n_head}, n_embd={n_embd} must all be positive"
            )
        if n_embd % n_head:
            raise ValueError(f"gpt: n_embd={n_embd} must be divisible by n_head={n_head}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"gpt: dropout={dropout} must lie in [0, 1)")
        self.block_size = block_size
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.h = nn.ModuleList(Block(n_embd, n_head, block_size, dropout, bias) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd, bias=bias)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        # Weight tying: one Parameter serves as input embedding and output projection.
        self.wte.weight = self.lm_head.weight
        self._init_weights(n_layer)

    def _init_weights(self, n_layer: int) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        # GPT-2: scale residual projections so the residual stream's variance does not grow with depth.
        for name, parameter in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(parameter, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @property
    def blocks(self) -> list[nn.Module]:
        """The transformer blocks in forward order.

        Example:
            ```python
            len(tandem.models.gpt(n_layer=4).blocks)   # 4
            ```
        """
        return list(self.h)

    def forward(self, tokens: Tensor) -> Tensor:
        """tokens: LongTensor (N, T) with T <= block_size -> logits (N, T, vocab_size).

        Example:
            ```python
            model = tandem.models.gpt(vocab_size=256, block_size=64)
            model(torch.randint(256, (4, 32))).shape    # (4, 32, 256)
            ```
        """
        seq_len = tokens.shape[1]
        if seq_len > self.block_size:
            raise ValueError(f"gpt: sequence length {seq_len} exceeds block_size={self.block_size}")
        positions = torch.arange(seq_len, device=tokens.device)
        x = self.drop(self.wte(tokens) + self.wpe(positions))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def gpt(
    vocab_size: int = 512,
    block_size: int = 64,
    n_layer: int = 4,
    n_head: int = 4,
    n_embd: int = 128,
    dropout: float = 0.1,
    bias: bool = True,
) -> GPT:
    """A small nanoGPT-style decoder-only transformer with tied embedding / lm_head.

    Example:
        ```python
        model = tandem.models.gpt(vocab_size=512, block_size=64, n_layer=4)
        trainer = tandem.Trainer(model, tandem.models.lm_loss, tandem.optim.AdamW(lr=3e-3))
        trainer.fit(tandem.data.synthetic_tokens(2048, seq_len=64, vocab_size=512), epochs=1)
        ```
    """
    return GPT(vocab_size, block_size, n_layer, n_head, n_embd, dropout, bias)
