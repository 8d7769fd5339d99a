"""Wrong: a piece runs to the end of the rank's rows, past the end of the file it is read from."""


def read_plan(rows, saved_by, loaded_by, rank):
    saved_rows, loaded_rows = -(-rows // saved_by), -(-rows // loaded_by)
    lo, hi = rank * loaded_rows, min((rank + 1) * loaded_rows, rows)
    pieces = []
    for saved in range(saved_by):
        start = max(lo, saved * saved_rows)
        if start < min(hi, (saved + 1) * saved_rows):
            pieces.append((saved, start, hi))  # the bug: not clipped at the file's last row
    return pieces
