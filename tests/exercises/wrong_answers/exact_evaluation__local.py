"""Wrong: nothing reduced: each rank returns its own shard's accuracy (the empty one 0.0)."""

import torch


def global_accuracy(model, x, y, num_classes):
    model.eval()
    with torch.no_grad():
        right = (model(x).argmax(dim=1) == y).double()
    per_class = [right[y == c].mean().item() if (y == c).any() else 0.0 for c in range(num_classes)]
    return (right.mean().item() if len(y) else 0.0), per_class
