"""The notebooks print each minimal script's diff from its base, read from the files at run time."""

from common.run.notebooks import MINIMAL, MINIMAL_BASE, minimal_diff, minimal_path


def test_minimal_diff_is_read_from_the_files():
    text = minimal_diff("03_ddp")
    assert text.startswith("--- minimal/01_single_gpu.py\n+++ minimal/03_ddp.py")
    assert "+from torch.nn.parallel import DistributedDataParallel as DDP" in text
    for number, base in MINIMAL_BASE.items():  # every base of an existing script exists
        if any(MINIMAL.glob(f"{number}_*.py")):
            minimal_path(base)
