"""The benchmark tools without a GPU: rows and their floors, the table run_all writes, and
bench_variants' CPU mechanisms (each setting timed in turn, the library's settings restored)."""
import os
import pathlib
import re

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _columns(line):
    return [c.strip() for c in line.strip().strip("|").split("|")]


def test_row_formatting_with_floor_note_and_missing_torchvision():
    from benchmarks.timing import HEADER, Row, format_row

    header = _columns(HEADER.splitlines()[0])
    assert header == ["case", "torchvision", "detops", "ratio (tv / detops)", "floor"]
    row = Row("roi_align fwd", "cuda", 0.1, 0.25, floor="41 µs (176 MB / 4.30 TB/s)")
    assert format_row(row) == "| roi_align fwd | 250 µs | 100 µs | 2.5x | 41 µs (176 MB / 4.30 TB/s) |"
    assert _columns(format_row(Row("nms", "cpu", 2.0, None))) == ["nms", "n/a", "2.00 ms", "n/a", ""]
    noted = Row("scaling", "cpu", 1.5, None, note="scaling 1.90x")
    assert _columns(format_row(noted)) == ["scaling", "n/a", "1.50 ms", "scaling 1.90x", ""]
    assert len(_columns(format_row(row))) == len(header)


def test_floors_from_bytes_and_instructions():
    from benchmarks.timing import byte_floor, dram_bandwidth, issue_floor

    assert byte_floor(176e6, 4.4e12) == "40 µs (176 MB / 4.40 TB/s)"
    assert byte_floor(5e9, 2.5e12) == "2.00 ms (5000 MB / 2.50 TB/s)"
    assert byte_floor(1e6, None) is None
    assert issue_floor("5e+09 pairs x 10 instructions", 5e10, 2.5e13) == "2.00 ms (5e+09 pairs x 10 instructions / 2.5e+13 per s)"
    assert issue_floor("x", 1.0, None) is None
    if not torch.cuda.is_available():
        assert dram_bandwidth() is None


def test_roi_byte_counts():
    """Every tensor a call reads or writes, once: on the CUDA cases' map (2x256x200x304 float32,
    1024 RoIs) the 7x7 forward moves the map (124.5 MB), the RoIs and the output (51.4 MB)."""
    from benchmarks.bench_roi import byte_count

    x = torch.empty(2, 256, 200, 304)
    rois = torch.empty(1024, 5)
    map_b, out_b, roi_b = 2 * 256 * 200 * 304 * 4, 1024 * 256 * 49 * 4, 1024 * 5 * 4
    assert byte_count("roi_align", "fwd", x, rois, 7) == map_b + roi_b + out_b
    assert byte_count("roi_align", "bwd", x, rois, 7) == out_b + roi_b + map_b
    assert byte_count("roi_align", "fwd+bwd", x, rois, 7) == 2 * (map_b + roi_b + out_b)
    # roi_pool: the forward without a gradient writes no argmax; the backward reads it
    assert byte_count("roi_pool", "fwd", x, rois, 7) == map_b + roi_b + out_b
    assert byte_count("roi_pool", "bwd", x, rois, 7) == out_b + roi_b + out_b + map_b
    assert byte_count("roi_pool", "fwd+bwd", x, rois, 7) == 2 * (map_b + roi_b + out_b) + 2 * out_b
    half = torch.empty(2, 256, 200, 304, dtype=torch.float16)
    assert byte_count("roi_align", "fwd", half, rois.half(), 14) == (map_b + roi_b + 1024 * 256 * 196 * 4) // 2


def test_nms_floor_is_launches_until_the_pair_tests_take_longer():
    from benchmarks.bench_nms import LAUNCH_FLOOR, nms_floor

    rate = 2.5e13
    assert nms_floor(1000, rate) == LAUNCH_FLOOR
    assert nms_floor(1000, None) == LAUNCH_FLOOR
    # 100k boxes: 5.0e9 pairs, 10 instructions each, 2 ms at 2.5e13 a second
    assert nms_floor(100_000, rate) == "2.00 ms (5e+09 pairs x 10 instructions / 2.5e+13 per s)"
    assert nms_floor(100_000, None) == LAUNCH_FLOOR


def test_run_all_writes_the_cpu_table(tmp_path, capsys):
    from benchmarks import run_all

    out = tmp_path / "table.md"
    run_all.main(["--quick", "--device", "cpu", "--only", "nms,roi", "--out", str(out)])
    text = out.read_text()
    lines = text.splitlines()
    assert lines[0] == "Measured with `python -m benchmarks.run_all --device cpu --only nms,roi --quick`:"
    assert any(line.startswith("- torch ") and "torchvision" in line for line in lines)
    assert any(line.startswith("- CPU: ") and "threads" in line for line in lines)
    heading = lines.index(next(line for line in lines if line.startswith("### CPU: ")))
    assert lines[heading + 2] == "| case | torchvision | detops | ratio (tv / detops) | floor |"
    rows = [line for line in lines[heading + 4:] if line.startswith("| ")]
    cases = [_columns(line)[0] for line in rows]
    assert "nms, 1k random, IoU 0.5" in cases and "roi_align fwd, 1x16x50x76, 32 RoIs, 7x7, fp32" in cases
    assert all(len(_columns(line)) == 5 for line in rows)
    # a measured row: both sides timed, and their ratio
    nms = _columns(rows[cases.index("nms, 1k random, IoU 0.5")])
    assert re.fullmatch(r"[\d.]+ (µs|ms)", nms[1]) and re.fullmatch(r"[\d.]+ (µs|ms)", nms[2])
    assert re.fullmatch(r"[\d.]+x", nms[3])
    assert "### CUDA" not in text and "### CPU: " in capsys.readouterr().out
    with pytest.raises(SystemExit):
        run_all.main(["--quick", "--device", "cpu", "--only", "nope"])


def _vector_choice():
    from detops import _C

    current = _C._set_cpu_vector("auto")
    _C._set_cpu_vector(current)
    return current


def _cache_limit():
    from detops import _C

    limit = _C._set_cpu_output_cache(0)
    _C._set_cpu_output_cache(limit)
    return limit


def test_bench_variants_quick_cpu_prints_and_writes_its_table(tmp_path, capsys):
    from benchmarks import bench_variants

    out = tmp_path / "variants.md"
    threads, vector, limit = torch.get_num_threads(), _vector_choice(), _cache_limit()
    bench_variants.main(["--quick", "--device", "cpu", "--out", str(out)])
    assert (torch.get_num_threads(), _vector_choice(), _cache_limit()) == (threads, vector, limit)
    printed = capsys.readouterr().out
    text = out.read_text()
    header = "| mechanism | case | with | without | gain (without / with) |"
    assert header in printed and header in text
    if os.path.exists("/proc/stat"):  # the other processes' share of the CPUs during the run
        assert re.search(r"Other processes used \d+ CPU seconds during the \d+ s of this run", text.splitlines()[-1])
    rows = [_columns(line) for line in text.splitlines() if line.startswith("| cpu_")]
    assert all(f"| {' | '.join(r)} |" in printed for r in rows)
    counts = [1] if torch.get_num_threads() == 1 else [1, torch.get_num_threads()]
    vector_rows = [r for r in rows if r[0] == "cpu_vector"]
    cache_rows = [r for r in rows if r[0] == "cpu_output_cache"]
    # 4 forwards x 4 vector paths, 2 ops, at each thread count
    assert len(vector_rows) == 16 * len(counts) and len(cache_rows) == 2 * len(counts)
    assert len(rows) == len(vector_rows) + len(cache_rows)
    for choice in bench_variants.VECTOR_CHOICES:
        assert sum(r[1].endswith(f": {choice} vs scalar") for r in vector_rows) == 4 * len(counts)
    assert {r[1].split(", 1x16x50x76")[0] for r in cache_rows} == {"roi_align fwd+bwd", "roi_pool fwd+bwd"}
    for r in rows:
        with_ms, without_ms = (float(v.split()[0]) * (1e-3 if v.endswith("µs") else 1) for v in r[2:4])
        assert with_ms > 0 and without_ms > 0
        assert float(r[4].rstrip("x")) == pytest.approx(without_ms / with_ms, rel=0.05, abs=0.01)


def test_bench_variants_only_and_unknown_names(capsys):
    from benchmarks import bench_variants

    results = bench_variants.run(["cpu"], only=["cpu_output_cache"], quick=True)
    assert results and {r.mechanism for r in results} == {"cpu_output_cache"}
    assert bench_variants.run(["cpu"], only=["roi_kernel", "cuda_graphs"], quick=True) == []
    with pytest.raises(SystemExit):
        bench_variants.main(["--quick", "--only", "cpu_vector,nope"])


def test_roi_kernel_rows_check_and_time_each_part():
    """The CUDA kernel-choice rows' code on the CPU, where both choices run the CPU kernels: each
    op, layout and part (forward, backward alone, forward+backward) checked and timed."""
    from benchmarks import bench_variants

    results = []
    bench_variants.roi_kernel_rows("cpu", True, results)
    assert [r.case for r in results] == [
        f"{op} {part}, fp32, 7x7, {layout}: auto vs gather"
        for op in ("roi_align", "roi_pool") for layout in ("NCHW", "channels_last") for part in ("fwd", "bwd", "fwd+bwd")]
    assert all(r.mechanism == "roi_kernel" and r.with_ms > 0 and r.without_ms > 0 for r in results)


def test_roi_choice_check_catches_a_wrong_gradient():
    from benchmarks import bench_variants
    from detops.testing import random_rois

    x = torch.randn(1, 4, 20, 24)
    rois = random_rois(8, 1, 20, 24, seed=0, spatial_scale=0.25)
    grad = torch.randn(8, 4, 7, 7)
    bench_variants.check_roi_choice("auto", detops_roi_align, torchvision_roi_align, x, rois, grad)
    doubled = lambda a, r: _DoubleGrad.apply(detops_roi_align(a, r))  # noqa: E731
    with pytest.raises(AssertionError):
        bench_variants.check_roi_choice("auto", doubled, torchvision_roi_align, x, rois, grad)


def detops_roi_align(a, r):
    import detops

    return detops.ops.roi_align(a, r, 7, 0.25, 2, True)


def torchvision_roi_align(a, r):
    import torchvision

    return torchvision.ops.roi_align(a, r, 7, 0.25, 2, True)


class _DoubleGrad(torch.autograd.Function):
    """The identity, whose backward doubles the gradient."""

    @staticmethod
    def forward(ctx, t):
        return t.clone()

    @staticmethod
    def backward(ctx, g):
        return 2 * g


def test_alternate_takes_turns_and_keeps_each_settings_times(monkeypatch):
    """Each round times every setting once, in reversed order every other round, and each
    setting's result is the median of its own rounds."""
    import contextlib

    from benchmarks import bench_variants

    entered, current = [], []

    def setting(name):
        @contextlib.contextmanager
        def enter():
            entered.append(name)
            current.append(name)
            yield
            current.pop()
        return enter

    per_call = {"a": iter([1.0, 5.0, 3.0]), "b": iter([10.0, 30.0, 20.0])}
    monkeypatch.setattr(bench_variants, "median_ms", lambda fn, device, **kw: next(per_call[current[-1]]))
    got = bench_variants.alternate(lambda: None, [setting("a"), setting("b")], "cpu", bench_variants.Runs(3, 1, 0))
    assert entered == ["a", "b", "b", "a", "a", "b"]
    assert got == [3.0, 20.0]


def test_vector_paths_must_give_the_scalar_bits():
    """A forward whose bits differ under a vector path from the scalar code's stops the run."""
    from benchmarks import bench_variants

    def choice_length():  # the current choice's name, as a length: "auto" 4, "scalar" 6
        return torch.tensor([float(len(_vector_choice()))])

    bench_variants.check_vector_paths("same", lambda: (torch.ones(2), torch.arange(3)))
    with pytest.raises(SystemExit, match="probe under cpu_vector\\('auto'\\) differs from the scalar code"):
        bench_variants.check_vector_paths("probe", choice_length)
    assert _vector_choice() == "auto"


def test_graph_runners_are_found_and_swapped_back():
    """bench_variants turns the detector's CUDA graphs off by swapping its runners: the
    backbone's, the RPN's and the box head sampler's, all put back afterwards."""
    from benchmarks import bench_variants
    from detops.config import get_cfg
    from detops.modeling import build_detection_model
    from detops.modeling.cuda_graph import GraphedFunction, GraphedTraining

    cfg = get_cfg()
    cfg.merge_from_file(os.path.join(ROOT, "configs", "shapes_mask_rcnn_R_18_FPN.yaml"))
    cfg.merge_from_list(["MODEL.FPN.OUT_CHANNELS", 32, "MODEL.ROI_BOX_HEAD.MLP_HEAD_DIM", 64])
    model = build_detection_model(cfg)
    places = bench_variants.graph_runners(model)
    names = sorted(name for _, name in places)
    assert names == ["backbone_graphs", "graphs", "target_graphs"]
    assert model.backbone_graphs in [getattr(o, n) for o, n in places]
    before = [getattr(o, n) for o, n in places]
    off = [type(r)(max_graphs=0, after=r.after, warmup=r.warmup) for r in before]
    with bench_variants.installed(places, off):
        assert all(getattr(o, n).max_graphs == 0 for o, n in places)
        assert isinstance(model.backbone_graphs, GraphedTraining)
        assert isinstance(model.rpn.target_graphs, GraphedFunction)
    assert [getattr(o, n) for o, n in places] == before
    assert all(r.max_graphs > 0 for r in before)
