"""Wrong: each piece's rows counted from the start of its file, not in the whole tensor."""


def read_plan(rows, saved_by, loaded_by, rank):
    saved_rows, loaded_rows = -(-rows // saved_by), -(-rows // loaded_by)
    lo, hi = rank * loaded_rows, min((rank + 1) * loaded_rows, rows)
    pieces = []
    for saved in range(saved_by):
        start, end = max(lo, saved * saved_rows), min(hi, (saved + 1) * saved_rows)
        if start < end:
            pieces.append((saved, start - saved * saved_rows, end - saved * saved_rows))
    return pieces
