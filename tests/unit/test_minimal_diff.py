"""The notebooks print each minimal script's diff from its nearest earlier sibling (or the whole script),
read from the files at run time; the chain is derived from the tree, not a table."""

from common.run.minimal_chain import (
    MAX_CHANGED,
    changed_lines,
    minimal_base,
    minimal_diff,
    minimal_path,
    minimal_scripts,
)


def test_minimal_diff_is_read_from_the_files():
    text = minimal_diff("03_ddp")
    assert text.startswith("--- minimal/01_single_gpu.py\n+++ minimal/03_ddp.py")
    assert "+from torch.nn.parallel import DistributedDataParallel as DDP" in text


def test_every_script_is_a_small_diff_or_shown_whole():
    for number, path in minimal_scripts().items():
        base = minimal_base(number)
        if base is None:
            assert minimal_diff(number).endswith(path.read_text())
        else:
            assert base < number
            assert changed_lines(minimal_path(base).read_text(), path.read_text()) <= MAX_CHANGED


def test_the_chain_picks_the_nearest_sibling(tmp_path):
    body = "".join(f"line {i}\n" for i in range(80))
    (tmp_path / "01_a.py").write_text(body)
    (tmp_path / "02_b.py").write_text(body.replace("line 3\n", "changed\n"))
    (tmp_path / "03_c.py").write_text(body.replace("line 3\n", "changed\n") + "more\n")
    (tmp_path / "04_d.py").write_text("other\n" * 90)
    assert minimal_base("02", tmp_path) == "01"
    assert minimal_base("03", tmp_path) == "02"  # 1 line from 02, 3 from 01
    assert minimal_base("04", tmp_path) is None  # 170 lines from every earlier one: shown whole
    assert minimal_diff("04", folder=tmp_path).startswith(
        "# minimal/04_d.py, the whole script (90 lines)"
    )
