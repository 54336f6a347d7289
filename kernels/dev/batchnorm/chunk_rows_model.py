#!/usr/bin/env python3
"""A model, in exact integers, of how batchnorm/02_nhwc_vec.cu splits rows into the reductions' chunks
(for_chunk_rows: chunk k = the row groups k, k + chunks, ... of VB / (c / 8) rows, last to first, the tensor's
last group peeled off when short) and how the finaliser counts each chunk's rows (ChunkRows), with the launchers'
split (cuda/bn.rs, Split::v8). Checks, for ResNet-152's BatchNorm shapes at batch 256 and random small ones, that
every row is read exactly once, every chunk has a row, and ChunkRows gives each chunk's count.
    python3 kernels/dev/batchnorm/chunk_rows_model.py      (prints the chunks checked; exit 1 on a mismatch)
"""
import random
import sys

VB = 256


def row_groups(rows, c):
    shift = 8 - ((c >> 3).bit_length() - 1)  # rstep = VB / G = 2^shift (G = c / 8 a power of two)
    return (rows + (1 << shift) - 1) >> shift


def rows_of_chunk(rows, c, chunk, chunks):
    """The rows each thread lane reads in for_chunk_rows, in its order."""
    rstep = VB // (c >> 3)
    ng = row_groups(rows, c)
    out = []
    for lane in range(rstep):
        gi = ng - 1 - (ng - 1 - chunk) % chunks
        if gi == ng - 1:
            r = gi * rstep + lane
            if r < rows:
                out.append(r)
            gi -= chunks
        while gi >= 0:
            out.append(gi * rstep + lane)
            gi -= chunks
    return out


def chunk_rows(rows, c, chunks, k):
    """ChunkRows(rows, 0, c, chunks)(k)."""
    rstep = VB // (c >> 3)
    ng = row_groups(rows, c)
    q = (ng - 1) // chunks
    m = (ng - 1) - q * chunks
    cut = ng * rstep - rows
    return (q + (1 if k <= m else 0)) * rstep - (cut if k == m else 0)


def split(rows, c, per_sm=3):
    """Split::v8's chunk count: 132 x per_sm, at least 16 rows a thread."""
    rstep = VB // (c >> 3)
    chunks = min(132 * per_sm, max(1, (rows + 16 * rstep - 1) // (16 * rstep)))
    rpc = (rows + chunks - 1) // chunks
    return (rows + rpc - 1) // rpc


def main():
    random.seed(1)
    n = 256
    cases = [(n * 12544, 64), (n * 3136, 64), (n * 3136, 256), (n * 784, 128), (n * 784, 512), (n * 196, 256),
             (n * 196, 1024), (n * 49, 512), (n * 49, 2048), (7, 8), (1, 2048)]
    cases += [(random.randrange(1, 20000), 8 << random.randrange(0, 9)) for _ in range(300)]
    checked, bad = 0, 0
    for rows, c in cases:
        for per_sm in (1, 3, 8):
            if rows * c > 4_000_000 and per_sm != 3:
                continue
            chunks = split(rows, c, per_sm)
            seen = bytearray(rows)
            for k in range(chunks):
                rs = rows_of_chunk(rows, c, k, chunks)
                checked += 1
                if not rs or len(rs) != chunk_rows(rows, c, chunks, k):
                    bad += 1
                    print(f"rows {rows} c {c} chunks {chunks}: chunk {k} reads {len(rs)}, "
                          f"ChunkRows says {chunk_rows(rows, c, chunks, k)}")
                for r in rs:
                    seen[r] += 1
            if any(v != 1 for v in seen):
                bad += 1
                print(f"rows {rows} c {c} chunks {chunks}: a row read {min(seen)} to {max(seen)} times")
    print(f"chunks checked: {checked}, mismatches: {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
