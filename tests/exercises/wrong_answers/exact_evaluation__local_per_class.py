"""Wrong: the overall accuracy reduced, the per-class one left local (rank 0 knows no class 2)."""

import torch

from exercises.solutions.exact_evaluation import global_accuracy as _right


def global_accuracy(model, x, y, num_classes):
    overall, _ = _right(model, x, y, num_classes)
    model.eval()
    with torch.no_grad():
        right = (model(x).argmax(dim=1) == y).double()
    return overall, [
        right[y == c].mean().item() if (y == c).any() else 0.0 for c in range(num_classes)
    ]
