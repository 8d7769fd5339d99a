"""Small models shared by the lessons: a CNN (lesson 01), an MLP stack, the residual MLP of lessons 07-18, and a
small causal transformer (lessons 19-21)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from common.measure.memory import saved_activation_bytes

__all__ = [
    "DigitsCNN",
    "mlp",
    "ResidualMLP",
    "CausalSelfAttention",
    "causal_sdpa",
    "TransformerBlock",
    "CausalTransformer",
]


class DigitsCNN(nn.Module):
    """A small CNN with BatchNorm for 8x8 digit images (about 38k parameters with width=16).

    Shapes: x (B, C, H, W) float -> logits (B, num_classes). H and W must be divisible by 2.

        conv3x3(C -> w)    + BN + ReLU     (B, w, H, W)
        conv3x3(w -> 2w)   + BN + ReLU     (B, 2w, H, W)
        maxpool 2x2                        (B, 2w, H/2, W/2)
        flatten -> Linear(2w*H*W/4 -> 64) + ReLU -> Linear(64 -> num_classes)

    Args:
        norm: "batch" (BatchNorm2d, the default) or "none"; lesson 06 swaps BatchNorm for SyncBatchNorm.
    """

    def __init__(
        self,
        in_channels: int = 1,
        num_classes: int = 10,
        width: int = 16,
        image_size: int = 8,
        norm: str = "batch",
    ):
        super().__init__()
        if norm not in ("batch", "none"):
            raise ValueError(f"norm must be 'batch' or 'none', got {norm!r}")
        if image_size % 2:
            raise ValueError(f"image_size must be even, got {image_size}")

        def bn(c: int) -> nn.Module:
            return nn.BatchNorm2d(c) if norm == "batch" else nn.Identity()

        self.features = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1, bias=norm == "none"),
            bn(width),
            nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, padding=1, bias=norm == "none"),
            bn(2 * width),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(2 * width * (image_size // 2) ** 2, 64),
            nn.ReLU(),
            nn.Linear(64, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def mlp(widths: list[int], activation: type[nn.Module] = nn.ReLU) -> nn.Sequential:
    """A stack of Linear layers with `activation` between them (none after the last).

    `mlp([64, 256, 256, 10])` maps (B, 64) -> (B, 10). Model-parallel lessons cut such a stack into stages.

    Raises:
        ValueError: fewer than two widths or a width below 1.
    """
    if len(widths) < 2 or min(widths) < 1:
        raise ValueError(f"mlp needs at least two positive widths, got {widths}")
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(widths) - 2:
            layers.append(activation())
    return nn.Sequential(*layers)


class ResidualMLP(nn.Module):
    """A stack of residual GELU MLP blocks for flattened 8x8 digits; no BatchNorm.

    Shapes: x (B, 1, 8, 8) or (B, 64) -> logits (B, 10).

        stem   Linear(64 -> w)                                  (B, w)
        block  h + Linear(w -> w) . GELU . Linear(w -> w) (h)    (B, w), `depth` times (common.models.mlp)
        head   GELU . Linear(w -> 10)                            (B, 10)

    Why no BatchNorm: BatchNorm normalises each micro-batch with its own mean and variance, so k micro-batches
    of 2 are not the same computation as one batch of 16 and accumulation could not equal the global step
    (lesson 06). LayerNorm would be fine (per sample); plain residual blocks keep the model small.

    With `checkpointing = True` each block runs under `torch.utils.checkpoint.checkpoint(use_reentrant=False)`
    (https://pytorch.org/docs/stable/checkpoint.html): autograd keeps only the block's input and recomputes
    the block's forward during backward. Per block that keeps 1 tensor of (B, w) instead of 3 (the first
    Linear's input, the GELU's input and the second Linear's input).
    """

    def __init__(
        self, width: int = 256, depth: int = 4, in_features: int = 64, num_classes: int = 10
    ):
        super().__init__()
        self.stem = nn.Linear(in_features, width)
        self.blocks = nn.ModuleList(
            mlp([width, width, width], activation=nn.GELU) for _ in range(depth)
        )
        self.head = nn.Sequential(nn.GELU(), nn.Linear(width, num_classes))
        self.checkpointing = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x.flatten(1))  # (B, w)
        for block in self.blocks:
            if self.checkpointing and torch.is_grad_enabled():
                # Keeps only `h` (B, w) for backward; the block's inner tensors are recomputed during backward.
                h = h + checkpoint(block, h, use_reentrant=False)
            else:
                h = h + block(h)
        return self.head(h)

    def bf16_weight_copy_bytes(self) -> int:
        """Bytes of the bf16 weight copies autocast keeps for backward: it saves a Linear's weight when backward
        needs it for the input's gradient, so every Linear but the stem, whose input x needs none; 2 bytes each."""
        return 2 * sum(
            p.numel()
            for n, p in self.named_parameters()
            if n.endswith("weight") and n[:4] != "stem"
        )

    def activation_bytes(self, x: torch.Tensor, checkpointing: bool = False) -> int:
        """`saved_activation_bytes` of one forward of a copy of `x`, with or without checkpointing, under the
        caller's autocast. A copy: a slice x[:b] is a view that keeps (and would count) all of x's storage."""
        before, self.checkpointing = self.checkpointing, checkpointing
        try:
            return saved_activation_bytes(self, lambda: self(x.clone()))
        finally:
            self.checkpointing = before


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention whose attention function is an attribute, so a lesson can swap it.

    `attend(q, k, v) -> out`, all (B, heads, S, head_dim): by default `F.scaled_dot_product_attention` with
    is_causal=True on the whole sequence. Lesson 19 sets it to ring attention (each rank holds S/cp tokens and
    the function knows which); the projections around it do not change.
    """

    def __init__(self, d_model: int, heads: int):
        super().__init__()
        if d_model % heads:
            raise ValueError(f"heads ({heads}) must divide d_model ({d_model})")
        self.heads = heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.attend = causal_sdpa

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (B, S, d_model)
        B, S, C = x.shape
        qkv = self.qkv(x).view(B, S, 3, self.heads, C // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each (B, nh, S, hs)
        y = self.attend(q, k, v)  # (B, nh, S, hs)
        return self.proj(y.transpose(1, 2).reshape(B, S, C))


def causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """PyTorch's attention with a causal mask, on a sequence one process holds whole."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attn(ln1(x)), then x + mlp(ln2(x)). `mlp` is a slot: any module (B, S, C) ->
    (B, S, C) fits (lesson 20 puts a mixture of experts there)."""

    def __init__(self, d_model: int, heads: int, mlp: nn.Module | None = None):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, heads)
        self.mlp = (
            mlp
            if mlp is not None
            else nn.Sequential(
                nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model)
            )
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class CausalTransformer(nn.Module):
    """A small GPT: token embedding + learned positions, `n_layers` TransformerBlocks, LayerNorm, head.

    Made for the digits read as 64 pixel tokens (values 0..16, `vocab` 17; `common.data.digit_sequences`),
    trained to predict each next pixel. Shapes: tokens (B, S) int64 -> logits (B, S, vocab).

    Args:
        mlp_factory: builds each block's MLP (None: Linear-GELU-Linear with 4 x d_model hidden features).

    forward(tokens, positions): `positions` (S,) are the tokens' places in the whole sequence (default
    0..S-1). A context-parallel rank holds only some tokens (lesson 19's zig-zag: two chunks) and passes
    their positions; every other layer works token by token, and attention is `set_attention`'s function.
    """

    def __init__(
        self,
        vocab: int = 17,
        d_model: int = 32,
        heads: int = 4,
        n_layers: int = 2,
        max_len: int = 64,
        mlp_factory=None,
    ):
        super().__init__()
        self.max_len = max_len
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(max_len, d_model)
        self.blocks = nn.ModuleList(
            TransformerBlock(d_model, heads, mlp_factory() if mlp_factory else None)
            for _ in range(n_layers)
        )
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)

    def set_attention(self, attend) -> CausalTransformer:
        """Use `attend(q, k, v) -> out` in every block (e.g. ring attention); returns self."""
        for block in self.blocks:
            block.attn.attend = attend
        return self

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok(tokens) + self.pos(positions)  # (B, S, d_model)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))  # (B, S, vocab)
