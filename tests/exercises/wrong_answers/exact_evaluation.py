"""Wrong: the mean of the ranks' accuracies (an empty shard skipped), overall and per class."""

import torch
import torch.distributed as dist


def global_accuracy(model, x, y, num_classes):
    model.eval()
    with torch.no_grad():
        right = model(x).argmax(dim=1) == y
    # per rank: (accuracy, 1) for the overall and each class it holds, (0, 0) otherwise
    held = [right] + [right[y == c] for c in range(num_classes)]
    ratios = torch.tensor([[r.double().mean().item(), 1.0] if len(r) else [0.0, 0.0] for r in held])
    dist.all_reduce(ratios)
    means = (ratios[:, 0] / ratios[:, 1]).tolist()
    return means[0], means[1:]
