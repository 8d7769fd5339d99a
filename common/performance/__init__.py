"""DDP's communication hooks and torch.compile's graphs, counted (lesson 17)."""
