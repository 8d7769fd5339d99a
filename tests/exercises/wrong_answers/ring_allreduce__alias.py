"""Wrong: dist.all_reduce bound at import (`from torch.distributed import all_reduce`), out of reach of a
ban that patches only torch.distributed."""
from torch.distributed import all_reduce as _sum_everywhere  # bound before the grader patches dist
def ring_all_reduce(tensor):
    _sum_everywhere(tensor)
