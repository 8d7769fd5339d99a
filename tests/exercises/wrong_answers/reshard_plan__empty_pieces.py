"""Wrong: a piece for every saved file, empty ones included."""


def read_plan(rows, saved_by, loaded_by, rank):
    saved_rows, loaded_rows = -(-rows // saved_by), -(-rows // loaded_by)
    lo, hi = rank * loaded_rows, min((rank + 1) * loaded_rows, rows)
    return [
        (saved, max(lo, saved * saved_rows), max(lo, min(hi, (saved + 1) * saved_rows)))
        for saved in range(saved_by)
    ]
