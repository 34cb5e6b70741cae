"""The benchmark tools: patches and sources outside the library still match it, the CPU
scaling tool's per-core mode pins and restores, and its threads-against-processes arithmetic."""
import os
import pathlib
import re

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]


def hunks(patch_text):
    """(target path, [(old-side lines of one hunk)]) for each file of a unified diff; the path
    is "+" followed by the new path for a file the diff adds."""
    files = []
    for block in re.split(r"^diff --git ", patch_text, flags=re.M)[1:]:
        changed = re.search(r"^--- a/(\S+)$", block, flags=re.M)
        target = changed.group(1) if changed else "+" + re.search(r"^\+\+\+ b/(\S+)$", block, flags=re.M).group(1)
        olds = []
        for hunk in re.split(r"^@@ [^\n]*@@[^\n]*\n", block, flags=re.M)[1:]:
            lines = hunk.split("\n")
            olds.append([line[1:] for line in lines if line[:1] in (" ", "-")])
        files.append((target, olds))
    return files


@pytest.mark.parametrize(
    "patch, targets",
    [
        ("band_trace.patch", ["csrc/cuda/roi_align_band.cu"]),
        ("band_tiles.patch", ["+benchmarks/band_tiles.py", "csrc/cuda/roi_align_band.cu"]),
        ("band_ring.patch", ["csrc/cuda/roi_align_band.cu"]),
    ],
)
def test_band_patches_apply_to_the_band_forward(patch, targets):
    """benchmarks/band_trace.patch instruments roi_align_band.cu, band_tiles.patch and
    band_ring.patch add the tiled and the ring forward measured in BENCHMARKS.md: every hunk's
    context and removed lines must still be in the file, in order, and the files they add must
    not exist, or `git apply` fails."""
    files = hunks((ROOT / "benchmarks" / patch).read_text())
    assert [target for target, _ in files] == targets
    for target, olds in files:
        if target.startswith("+"):
            assert not (ROOT / target[1:]).exists()
            continue
        source = (ROOT / target).read_text()
        assert len(olds) >= 4
        for old in olds:
            assert "\n".join(old) in source, f"{patch} no longer applies to {target}:\n" + "\n".join(old)


def test_band_staging_matches_the_band_plan():
    """benchmarks/band_staging.cu copies bands shaped as the float32 band forward stages them
    on the benchmark maps (32-byte pixels, rows of 2 mod 4 pixels)."""
    source = (ROOT / "benchmarks" / "band_staging.cu").read_text()
    shape = re.search(r"constexpr int B = 2, C = 256, H = 200, W = 304, ROWS = (\d+), CORE = (\d+), BANDS = (\d+), STRIDE = (\d+)", source)
    rows, core, bands, stride = (int(v) for v in shape.groups())
    assert stride >= 304 and stride % 4 == 2
    assert rows * stride * 32 <= 227 * 1024  # one block's shared memory on sm_90
    assert bands == -(-200 // core) and rows > core


def test_band_schedule_model():
    """benchmarks/band_schedule.py models the float32 band forward's blocks: its plan is the
    kernel's on the benchmark maps (the bands band_staging.cu copies), it lists every bin row
    of the benchmark RoIs once, and it hands blocks to the SM free first."""
    from benchmarks import band_schedule
    from detops.testing import random_rois

    # 13 bands an image: band 12 holds rows [180, 200), and a 14th would lie inside it
    assert band_schedule.band_plan(200, 304, 7, 2, 232448) == (15, 8, 13)
    assert band_schedule.band_plan(200, 304, 14, 2, 232448) == (18, 5, 11)
    rois = random_rois(1024, 2, 200, 304, seed=0, spatial_scale=0.25)
    counts = band_schedule.bin_rows_per_key(rois, 2, 200, 7, 2, 0.25, 15, 13)
    assert len(counts) == 27 and sum(counts) == 1024 * 7 and counts[-1] == 0
    # two SMs, three blocks of 10 bin rows at 1 µs each, 1 µs of staging: the third block
    # starts on the first SM at 11 µs; the second SM then waits 11 µs
    kernel, idle = band_schedule.schedule([10, 10, 10], 2, first=1.0, later=1.0, per_row=1000.0, gap=0.0)
    assert (kernel, idle) == (22.0, 5.5)
    # three keys and the discard key, three groups: the last row split at a multiple of 4
    # entries (at or below half, or 5/8, of each list); the last three rows (the split row
    # included) take their keys longest list first, equal lists in key order, the discard key's
    # column in its place
    column = [9, 20, 9, 0]
    assert band_schedule.grid_blocks(column, 3, split=False) == column * 3
    assert band_schedule.grid_blocks(column, 3) == column * 2 + [4, 8, 4, 0] + [5, 12, 5, 0]
    assert band_schedule.grid_blocks(column, 3, heavy_rows=3) == [9, 20, 9, 0, 20, 9, 9, 0, 8, 4, 4, 0, 12, 5, 5, 0]
    assert band_schedule.grid_blocks(column, 3, heavy_rows=3, first=5 / 8) == [
        9, 20, 9, 0, 20, 9, 9, 0, 12, 4, 4, 0, 8, 5, 5, 0]


needs_affinity = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs os.sched_setaffinity")


@needs_affinity
def test_cpu_scaling_cores_times_each_core_and_restores_affinity(monkeypatch, capsys):
    from benchmarks import cpu_scaling

    seen = []
    monkeypatch.setattr(
        cpu_scaling, "selected_cases", lambda names: [("probe", lambda: seen.append(os.sched_getaffinity(0)), 3)]
    )
    cores, threads = os.sched_getaffinity(0), torch.get_num_threads()
    cpu_scaling.time_cores("t", None, 2)
    assert os.sched_getaffinity(0) == cores
    assert torch.get_num_threads() == threads
    # every call runs pinned to one core, and each pass visits every core
    assert all(len(s) == 1 for s in seen)
    assert sorted({next(iter(s)) for s in seen}) == sorted(cores)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("t probe pass")]
    assert len(lines) == 2
    assert all(len(re.findall(r" \d+:\d+\.\d\d", line)) == len(cores) for line in lines)


@needs_affinity
def test_cpu_scaling_cores_restores_affinity_when_a_case_fails(monkeypatch):
    from benchmarks import cpu_scaling

    def fail():
        raise RuntimeError("case failed")

    monkeypatch.setattr(cpu_scaling, "selected_cases", lambda names: [("fail", fail, 3)])
    cores, threads = os.sched_getaffinity(0), torch.get_num_threads()
    with pytest.raises(RuntimeError, match="case failed"):
        cpu_scaling.time_cores("t", None, 1)
    assert os.sched_getaffinity(0) == cores
    assert torch.get_num_threads() == threads


def test_cpu_scaling_versus_round_arithmetic():
    from benchmarks import cpu_scaling

    # processes at 2 and 4 ms per call: 0.75 calls per ms, one call split over them 4/3 ms
    split, scaling, procs, share = cpu_scaling.versus_round(3.0, 1.5, [2.0, 4.0])
    assert split == pytest.approx(4 / 3)
    assert scaling == pytest.approx(2.0)
    assert procs == pytest.approx(2.25)
    assert share == pytest.approx(1 / (1.5 * 0.75))


def test_cpu_scaling_pair_scores():
    from benchmarks import cpu_scaling

    assert cpu_scaling.pair_slowdowns(4.0, 5.0, 6.0, 5.0) == pytest.approx((1.5, 1.0, 1.5 ** 0.5))
    # 0 and 2 slow each other most; 1's worst partner is 0, whose worst is 2: not mutual
    score = {(0, 1): 1.1, (0, 2): 1.6, (0, 3): 1.0, (1, 2): 1.0, (1, 3): 1.05, (2, 3): 1.0}
    assert cpu_scaling.mutual_partners(score, [0, 1, 2, 3]) == [(0, 2)]


@needs_affinity
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 if hasattr(os, "sched_getaffinity") else True, reason="needs 2 cores")
def test_cpu_scaling_versus_runs_pinned_processes_and_restores_threads(capsys):
    from benchmarks import cpu_scaling

    threads = torch.get_num_threads()
    cpu_scaling.versus(["ref", "fwd"], 2, 2, 0.05)
    assert torch.get_num_threads() == threads
    out = capsys.readouterr().out.splitlines()
    for name in ("ref", "fwd"):
        rounds = [line for line in out if line.startswith(f"{name} round ")]
        assert len(rounds) == 2 and all("page faults a call" in line for line in rounds)
        summary = [line for line in out if line.startswith(f"{name}: 2 threads ")]
        assert len(summary) == 1 and "of the processes' throughput" in summary[0]
    with pytest.raises(SystemExit, match="unknown cases"):
        cpu_scaling.versus(["nope"], 2, 1, 0.05)
    with pytest.raises(SystemExit, match="--versus needs"):
        cpu_scaling.versus(["ref"], len(os.sched_getaffinity(0)) + 1, 1, 0.05)


@needs_affinity
def test_cpu_scaling_pinned_workers_pin_run_cases_and_close():
    from benchmarks import cpu_scaling

    core = min(os.sched_getaffinity(0))
    with cpu_scaling.PinnedWorkers([core]) as workers:
        for case in ("ref", "pool_fwd"):
            ms = workers.run(case, [core], 0.02)
            assert set(ms) == {core} and ms[core] > 0
        procs = list(workers.workers.values())
    assert all(p.returncode == 0 for p in procs)


def test_cpu_scaling_roi_pool_parts_give_the_forward_backward_gradient():
    """The parts of roi_pool's forward+backward that --versus can time one by one: the forward
    with argmax, the backward op on a saved argmax, and the two in turn, each the same kernels
    and gradient as the case through autograd."""
    from benchmarks import cpu_scaling

    fns = {name: fn for name, fn, _ in cpu_scaling.cases()}
    whole = fns["pool_fwd+bwd"]()
    out, argmax = fns["pool_argmax"]()
    assert out.shape == argmax.shape == (256, 64, 7, 7) and argmax.dtype == torch.int32
    for part in ("pool_bwd", "pool_argmax+bwd"):
        assert torch.equal(fns[part](), whole), part


def test_cpu_scaling_vectors_times_each_choice_and_restores_threads(capsys):
    from benchmarks import cpu_scaling
    from detops import _C

    threads = torch.get_num_threads()
    med = cpu_scaling.vectors(["avx2", "sse2", "scalar"], 1, 1, 1)
    assert torch.get_num_threads() == threads
    assert _C._set_cpu_vector("auto") == "auto"  # each choice was undone
    forwards = ("values", "argmax", "values_cl", "argmax_cl")
    assert set(med) == {(f, c) for f in forwards for c in ("avx2", "sse2", "scalar")}
    assert all(v > 0 for v in med.values())
    out = capsys.readouterr().out
    assert "roi_pool forwards, small map, 1 threads: avx2: values" in out and "scalar: values" in out


def test_cpu_scaling_vectors_stops_where_choices_disagree(monkeypatch):
    from benchmarks import cpu_scaling
    from detops import _C

    def probe():  # the name of the current choice, as a length
        current = _C._set_cpu_vector("auto")
        _C._set_cpu_vector(current)
        return torch.tensor([float(len(current))])

    forwards = [(name, probe) for name in ("values", "argmax", "values_cl", "argmax_cl")]
    monkeypatch.setattr(cpu_scaling, "roi_pool_forwards", lambda large: forwards)
    cpu_scaling.vectors(["avx2", "sse2"], 1, 1, 2)  # equal lengths: the same "bits"
    with pytest.raises(SystemExit, match="values under cpu_vector\\('scalar'\\) differs from 'avx2'"):
        cpu_scaling.vectors(["avx2", "scalar"], 1, 1, 2)
    assert _C._set_cpu_vector("auto") == "auto"


def test_transpose_variants_take_the_library_kernel():
    """benchmarks/transpose_variants.py compiles the library's transpose kernel from
    csrc/cuda/to_channels_last.cu in other shapes: the text between its markers is that kernel,
    and the shapes the library launches are among the variants it times."""
    from benchmarks import transpose_variants as tv

    kernel = tv.library_kernel()
    assert "__global__ void __launch_bounds__(kLanes * Rows, MinBlocks) nchw_to_nhwc_kernel(" in kernel
    assert "void launch_transpose" not in kernel and "TORCH_LIBRARY_IMPL" not in kernel
    source = tv.source()
    assert kernel in source and "@" not in source.replace(kernel, "")
    library = tv.LIBRARY.read_text()
    # 4 and 8-byte values: K2 R4; 2-byte values: K2 R8 with at least 4 blocks an SM
    assert "launch_transpose<Bits, K, 4, 1>" in library and "launch_transpose<Bits, K, 8, 4>" in library
    assert (2, 4, 1) in tv.VARIANTS[4] and (2, 8, 4) in tv.VARIANTS[2]


def test_cpu_scaling_faults_times_threads_and_processes(capsys):
    from benchmarks import cpu_scaling

    threads = torch.get_num_threads()
    cpu_scaling.faults(2, mib=1, reps=2, lead=0.0)
    assert torch.get_num_threads() == threads
    out = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in out] == [
        "fresh pages,  1 thread of one process", "fresh pages,  2 threads of one process",
        "fresh pages,  1 process at once, one thread each", "fresh pages,  2 processes at once, one thread each"]
    assert all(re.search(r"\d+\.\d{3} us a page", line) for line in out)
    # a fill of fresh pages and again: 256 pages a MiB, each adding what it took beyond the refill
    assert cpu_scaling.page_us(1, 2.0, 1.0) == pytest.approx(1e3 / 256)
    assert cpu_scaling.page_us(1, 1.0, 2.0) == 0.0


def test_cpu_scaling_cache_ab_alternates_and_restores(monkeypatch, capsys):
    from benchmarks import cpu_scaling
    from detops import _C

    limits = []  # the cache's limit at each call of the probe, read by setting it back
    def probe():
        limit = _C._set_cpu_output_cache(0)
        _C._set_cpu_output_cache(limit)
        limits.append(limit >> 20)

    monkeypatch.setattr(cpu_scaling, "selected_cases", lambda names: [("probe", probe, 3)])
    before_threads, before_limit = torch.get_num_threads(), _C._set_cpu_output_cache(3 << 20)
    try:
        cpu_scaling.cache_ab(None, 1, 3, 0.01, 64)
        assert torch.get_num_threads() == before_threads
        assert _C._set_cpu_output_cache(0) == 3 << 20  # set back
        # rounds off-on, on-off, off-on: four stretches of calls at one setting each
        runs = [k for i, k in enumerate(limits) if i == 0 or limits[i - 1] != k]
        assert runs == [0, 64, 0, 64]
        line = capsys.readouterr().out.strip()
        assert line.startswith("probe 1 thread: cache off ") and "on (64 MiB)" in line and "of 3 rounds" in line
        with pytest.raises(SystemExit, match="--cache-ab needs a positive MiB"):
            cpu_scaling.cache_ab(None, 1, 1, 0.01, 0)
    finally:
        _C._set_cpu_output_cache(0)
        _C._set_cpu_output_cache(before_limit)
