"""DDP's buckets and torch.compile's graphs, counted (lesson 17)."""
