"""Wrong: the mean of the ranks' accuracies (an empty shard counted as 0 of 0 -> skipped)."""
import torch
import torch.distributed as dist


def global_accuracy(model, x, y):
    model.eval()
    with torch.no_grad():
        acc = (model(x).argmax(dim=1) == y).float().mean().item() if len(y) else float("nan")
    both = torch.tensor([0.0 if acc != acc else acc, 0.0 if acc != acc else 1.0])
    dist.all_reduce(both)
    return (both[0] / both[1]).item()
