"""The notebooks' pictures, drawn from the runs' own tensors and groups."""
