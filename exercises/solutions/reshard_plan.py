"""Reference solution of exercises/reshard_plan.py (lesson 15); lesson 15's read_plan counts the same overlaps
in bytes."""


def read_plan(rows: int, saved_by: int, loaded_by: int, rank: int) -> list[tuple[int, int, int]]:
    saved_rows, loaded_rows = (
        -(-rows // saved_by),
        -(-rows // loaded_by),
    )  # ceil: torch.chunk's split
    lo, hi = rank * loaded_rows, min((rank + 1) * loaded_rows, rows)  # the rows this rank holds now
    pieces = []
    for saved in range(saved_by):
        start, end = max(lo, saved * saved_rows), min(hi, (saved + 1) * saved_rows)
        if start < end:  # the overlap of what it needs and what that file holds
            pieces.append((saved, start, end))
    return pieces
