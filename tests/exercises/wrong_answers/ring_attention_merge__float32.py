import torch
def merge(out_a, lse_a, out_b, lse_b):
    # exp() of each lse minus the larger one: fine; but drops to float32 "for speed"
    la, lb = lse_a.float(), lse_b.float()
    lse = torch.logaddexp(la, lb)
    return (torch.exp(la - lse).unsqueeze(-1) * out_a.float() + torch.exp(lb - lse).unsqueeze(-1) * out_b.float()).double(), lse.double()
