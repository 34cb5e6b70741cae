"""A model of the float32 roi_align band forward's block schedule (no GPU needed).

    python -m benchmarks.band_schedule               # the benchmark inputs at 7x7
    python -m benchmarks.band_schedule --size 14 --per-row 50.6

roi_align_band_forward_rotated_kernel runs one block per SM, a block per (band of an image,
group of eight channels) in launch order: every band's first group, then every band's second,
and so on. This script lists each band's bin rows for the benchmark inputs (2x256x200x304 maps,
1024 RoIs, sampling ratio 2, aligned) by the taps kernel's rule (a bin row belongs to the band
whose core rows hold its first sample pixel row, or to the last band; one with no sample row on
the map to the discard key), gives each block a time (the first wave's staging, or a later
block's list read and staging, plus its bin rows' computation; times from
`benchmarks/band_trace.py`) and hands the blocks, in a given order, to whichever SM is free
first. It prints the modeled kernel time and each SM's idle time at the end for: launch order;
the last group's blocks split in two, the second halves in a row of blocks after the others
(what the kernel did where the grid has two waves or more until the change below); that split
with the keys of its last three rows (the last two groups and the split row) taken heaviest
first; that order with the lists cut 5/8 and 3/8, as the kernel does now; and each group's
bands ordered by their bin rows. BENCHMARKS.md,
"roi_align band forward: lists in shared memory, the last blocks split", "no band inside the
one before it, 768 threads" and "the last rows' keys heaviest first".
"""
import argparse
import heapq
import math
import statistics

from detops.testing import random_rois


def cdiv(a, b):
    return -(-a // b)


def band_plan(height, width, pooled, grid, smem_optin):
    """(core, overlap, bands) of the rotated forward's plan (rotated_plan in roi_align_band.cu)."""
    stride = width + (6 - width % 4) % 4
    rows = min((smem_optin - 1024) // (stride * 32), height)
    span = cdiv(height * (grid - 1), 2 * pooled * grid) + 2
    overlap = 0 if rows >= height else min(max(span - 1, 1), rows * 3 // 8)
    core = rows - overlap
    return core, overlap, cdiv(max(height - overlap, 1), core)


def bin_rows_per_key(rois, batch, height, pooled, grid, scale, core, bands):
    """Bin rows of each key (image * bands + band), and of the discard key (last)."""
    counts = [0] * (batch * bands + 1)
    for b, _, y1, _, y2 in rois.tolist():
        start = y1 * scale - 0.5
        bin_h = (y2 - y1) * scale / pooled
        for ph in range(pooled):
            first = None
            for q in range(grid):
                y = start + ph * bin_h + (q + 0.5) * bin_h / grid
                if y < -1.0 or y > height:
                    continue
                lo = min(int(math.floor(max(y, 0.0))), height - 1)
                first = lo if first is None else min(first, lo)
            counts[-1 if first is None else int(b) * bands + min(first // core, bands - 1)] += 1
    return counts


def schedule(blocks, sms, first, later, per_row, gap):
    """(kernel time, median idle time at the end per SM) in µs for blocks (bin rows each, in
    launch order) on `sms` SMs, each block going to the SM free first."""
    free = [(0.0, sm) for sm in range(sms)]
    end = [0.0] * sms
    for i, n in enumerate(blocks):
        t, sm = heapq.heappop(free)
        stage = first if i < sms else later
        t += (stage + n * per_row / 1e3 if n else 0.5) + gap
        end[sm] = t
        heapq.heappush(free, (t, sm))
    last = max(end)
    return last, statistics.median(last - e for e in end)


def grid_blocks(column, groups, split=True, heavy_rows=0, first=0.5):
    """Bin rows of each block in launch order: `groups` rows of the keys' counts `column` (the
    discard key last); with split, the last row's lists cut at the multiple of 4 entries at or
    below `first` of each (the kernel's 5/8 since the heavy-first order, 1/2 before) and the
    rest in a row of their own; the last heavy_rows rows (the split row included) with their
    keys longest list first, equal lists in key order, the discard key's column in its place
    (plane_band::list_keys_heaviest_first, in the grouping kernels)."""
    keys = len(column) - 1
    heavy = sorted(range(keys), key=lambda k: (-column[k], k)) + [keys]
    firsts = [int(n * first) // 4 * 4 for n in column]
    grid = [list(column) for _ in range(groups - 1)]
    grid += [firsts, [n - h for n, h in zip(column, firsts)]] if split else [list(column)]
    for r in range(max(len(grid) - heavy_rows, 0), len(grid)):
        grid[r] = [grid[r][k] for k in heavy]
    return [n for row in grid for n in row]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", type=int, default=7, help="pooled output size")
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--smem", type=int, default=232448, help="shared memory a block may opt in to (bytes)")
    ap.add_argument("--first", type=float, default=9.6, help="first wave: start to band staged (µs)")
    ap.add_argument("--later", type=float, default=4.6, help="later blocks: list read and staging (µs)")
    ap.add_argument("--per-row", type=float, default=34.6, help="computation per bin row (ns)")
    ap.add_argument("--gap", type=float, default=0.38, help="between two blocks on an SM (µs)")
    args = ap.parse_args()
    batch, channels, height, width, grid, scale = 2, 256, 200, 304, 2, 0.25
    rois = random_rois(1024, batch, height, width, seed=0, spatial_scale=scale)
    core, overlap, bands = band_plan(height, width, args.size, grid, args.smem)
    counts = bin_rows_per_key(rois, batch, height, args.size, grid, scale, core, bands)
    keys = batch * bands
    # channels_per_block: about four blocks per block slot (two a SM), eight channels at least
    groups = min(channels, cdiv(4 * 2 * args.sms, keys))
    rows = cdiv(channels, cdiv(cdiv(channels, groups), 8) * 8)
    print(
        f"{height}x{width} maps, bands of {core} + {overlap} rows: {bands} a map; {keys} keys x {rows} groups; "
        f"bin rows per key {counts[:-1]} (discarded {counts[-1]})"
    )
    column = counts[:-1] + [0]  # the discard key's blocks write zeros and end
    by_rows = sorted(column, reverse=True) * rows
    times = dict(first=args.first, later=args.later, per_row=args.per_row, gap=args.gap)
    for name, blocks in (
        ("launch order", grid_blocks(column, rows, split=False)),
        ("last group split in two", grid_blocks(column, rows)),
        ("split, the last three rows' keys heaviest first", grid_blocks(column, rows, heavy_rows=3)),
        ("the same, split 5/8 and 3/8 (the kernel)", grid_blocks(column, rows, heavy_rows=3, first=5 / 8)),
        ("each group's bands by bin rows", by_rows),
    ):
        kernel, idle = schedule(blocks, args.sms, **times)
        print(f"{name}: {len(blocks)} blocks, kernel {kernel:.1f} µs, idle at the end {idle:.1f} µs (median per SM)")


if __name__ == "__main__":
    main()
