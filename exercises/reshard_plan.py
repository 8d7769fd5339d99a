"""Exercise (lesson 15): the reading plan of a resharding load -- which rows of which saved file a rank reads.

Fill in `read_plan`, then grade it:  python -m exercises reshard_plan
(graded in one process over many sizes: your pieces, concatenated, must be exactly the rows the loading rank
holds, read from the files that hold them).
"""


def read_plan(rows: int, saved_by: int, loaded_by: int, rank: int) -> list[tuple[int, int, int]]:
    """The pieces loading rank `rank` of `loaded_by` reads from a checkpoint that `saved_by` ranks wrote.

    FSDP2 gives rank k of W ranks the rows [k c, min((k + 1) c, rows)) of a tensor, c = ceil(rows / W) (the
    split of torch.chunk: a rank past the end holds none); each saving rank's file holds its own rows.
    Return (saved rank, first row, end row) for every piece, rows counted in the WHOLE tensor, in row order,
    no empty piece. Example: rows 33, saved by 4 (9, 9, 9, 6 rows), loaded by 2 (17, 16): rank 0 reads
    [(0, 0, 9), (1, 9, 17)].

    Hint: the rows this rank needs and the rows each file holds are two intervals; a piece is their overlap.
    """
    raise NotImplementedError("read_plan")
