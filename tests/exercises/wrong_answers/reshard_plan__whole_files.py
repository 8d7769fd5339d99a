"""Wrong: every file that overlaps the rank's rows read whole, not only the overlap."""


def read_plan(rows, saved_by, loaded_by, rank):
    saved_rows, loaded_rows = -(-rows // saved_by), -(-rows // loaded_by)
    lo, hi = rank * loaded_rows, min((rank + 1) * loaded_rows, rows)
    pieces = []
    for saved in range(saved_by):
        start, end = saved * saved_rows, min((saved + 1) * saved_rows, rows)
        if max(lo, start) < min(hi, end):
            pieces.append((saved, start, end))
    return pieces
