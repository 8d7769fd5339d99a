"""Wrong: all_gather_object (a collective of pickled objects) instead of a ring of isend/irecv."""
import torch, torch.distributed as dist
def ring_all_reduce(tensor):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, tensor.clone())
    tensor.copy_(sum(out))
