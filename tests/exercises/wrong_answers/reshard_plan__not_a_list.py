"""Wrong: the pieces as a dict {saved rank: (first row, end row)}."""


def read_plan(rows, saved_by, loaded_by, rank):
    saved_rows, loaded_rows = -(-rows // saved_by), -(-rows // loaded_by)
    lo, hi = rank * loaded_rows, min((rank + 1) * loaded_rows, rows)
    pieces = {}
    for saved in range(saved_by):
        start, end = max(lo, saved * saved_rows), min(hi, (saved + 1) * saved_rows)
        if start < end:
            pieces[saved] = (start, end)
    return pieces
