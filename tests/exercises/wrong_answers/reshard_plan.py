"""Wrong: rows per rank as rows // W (floor), not torch.chunk's ceil(rows / W)."""


def read_plan(rows, saved_by, loaded_by, rank):
    saved_rows, loaded_rows = rows // saved_by or 1, rows // loaded_by or 1
    lo, hi = rank * loaded_rows, min((rank + 1) * loaded_rows, rows)
    if rank == loaded_by - 1:
        hi = rows
    pieces = []
    for saved in range(saved_by):
        end_of_file = rows if saved == saved_by - 1 else (saved + 1) * saved_rows
        start, end = max(lo, saved * saved_rows), min(hi, end_of_file)
        if start < end:
            pieces.append((saved, start, end))
    return pieces
