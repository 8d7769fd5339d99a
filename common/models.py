"""Small models shared by the lessons (introduced in lesson 01)."""
from __future__ import annotations

import torch
import torch.nn as nn

__all__ = ["DigitsCNN", "mlp"]


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

    def __init__(self, in_channels: int = 1, num_classes: int = 10, width: int = 16, image_size: int = 8,
                 norm: str = "batch"):
        super().__init__()
        if norm not in ("batch", "none"):
            raise ValueError(f"norm must be 'batch' or 'none', got {norm!r}")
        if image_size % 2:
            raise ValueError(f"image_size must be even, got {image_size}")

        def bn(c: int) -> nn.Module:
            return nn.BatchNorm2d(c) if norm == "batch" else nn.Identity()

        self.features = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1, bias=norm == "none"), bn(width), nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, padding=1, bias=norm == "none"), bn(2 * width), nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(2 * width * (image_size // 2) ** 2, 64), nn.ReLU(),
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
