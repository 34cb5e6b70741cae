"""Concurrent calls: every op called from several Python threads at once on the CPU, and on
several CUDA streams at once, gives the bits of serial calls.

Each thread (or stream) runs its own inputs (its seed), several times, all threads released
together by a barrier, so that calls overlap and a result written into another call's output
would show. What this relies on, and what holds:
  * the CPU kernels write only their own outputs; the CPU backwards are deterministic whatever
    the thread count, so a gradient computed while other calls run has the serial bits;
  * the CPU output cache (csrc/cpu/output_cache.h), shared by all threads, hands a freed buffer
    to one output at a time: with it on, results are the same;
  * the kernel settings (roi_kernel on CUDA, cpu_vector for the CPU roi_pool, nms_kernel where
    the build has it) are process-wide atomics, read once per call. Concurrent calls under one
    setting give that setting's serial bits. cpu_vector's paths give the same bits, so results
    hold even while another thread switches it mid-run; the CUDA roi_align kernels agree only to
    rounding, so on CUDA a setting is fixed for the whole run;
  * on CUDA each stream's calls are ordered on that stream only; the forwards are
    deterministic, and so are the backwards under torch.use_deterministic_algorithms(True)
    (otherwise they add with atomics, and only agree within rounding).
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Dict, List, Tuple

import pytest
import torch

import detops
from detops import _C
from detops.ops import MultiScaleRoIAlign, batched_nms, nms, nms_padded, roi_align, roi_pool
from detops.ops import _utils
from detops.testing import clustered_boxes

THREADS = 6
REPEATS = 2
STREAMS = 4


# --- the ops: inputs(seed, device) and a call that returns a tuple of tensors ------------------


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _rois(seed, k, batch, height, width, scale):
    g = _gen(seed + 100)
    xy = torch.rand(k, 2, generator=g) * torch.tensor([width, height]) / scale
    wh = torch.rand(k, 2, generator=g) * 16 / scale + 1
    idx = torch.randint(0, batch, (k, 1), generator=g).float()
    return torch.cat([idx, xy, xy + wh], 1)


def nms_inputs(seed, device):
    b, s = clustered_boxes(1500, seed)
    return b.to(device), s.to(device)


def nms_call(b, s):
    return (nms(b, s, 0.5),)


def batched_nms_inputs(seed, device):
    b, s = clustered_boxes(1500, seed)
    return b.to(device), s.to(device), torch.randint(0, 5, (1500,), generator=_gen(seed)).to(device)


def batched_nms_call(b, s, i):
    return (batched_nms(b, s, i, 0.5),)


def nms_padded_inputs(seed, device):
    pairs = [clustered_boxes(800, seed * 8 + j) for j in range(4)]
    return torch.stack([p[0] for p in pairs]).to(device), torch.stack([p[1] for p in pairs]).to(device)


def nms_padded_call(b, s):
    return nms_padded(b, s, 0.5, 0.05, 200)


def roi_inputs(seed, device, channels_last=False):
    # an output of 256 x 64 x 7 x 7 floats (3.1 MiB) and a gradient of 1.5 MiB: both past the
    # 1 MiB from which the CPU output cache serves outputs
    x = torch.randn(2, 64, 48, 64, generator=_gen(seed)).to(device)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    rois = _rois(seed, 256, 2, 48, 64, 0.5).to(device)
    grad = torch.randn(256, 64, 7, 7, generator=_gen(seed + 1)).to(device)
    return x, rois, grad


def roi_align_call(x, rois, grad):
    x = x.detach().requires_grad_()
    out = roi_align(x, rois, 7, 0.5, 2, True)
    out.backward(grad)
    return out.detach(), x.grad


def roi_pool_call(x, rois, grad):
    x = x.detach().requires_grad_()
    out = roi_pool(x, rois, 7, 0.5)
    out.backward(grad)
    return out.detach(), x.grad, roi_pool(x.detach(), rois, 7, 0.5)


def msra_inputs(seed, device):
    g = _gen(seed)
    feats = {f"p{k}": torch.randn(2, 16, 256 >> k, 256 >> k, generator=g).to(device) for k in (2, 3, 4, 5)}
    boxes = []
    for i in range(2):
        xy = torch.rand(150, 2, generator=g) * 800
        wh = torch.rand(150, 2, generator=g) ** 2 * 500 + 4
        boxes.append(torch.cat([xy, xy + wh], 1).to(device))
    return feats, boxes


def msra_call(feats, boxes, train=False):
    feats = {k: v.detach().requires_grad_() for k, v in feats.items()}
    module = MultiScaleRoIAlign(list(feats), 7, 2).train(train)
    out = module(feats, boxes, [(1024, 1024), (1000, 1024)])
    out.backward(torch.ones_like(out))
    return (out.detach(),) + tuple(feats[k].grad for k in sorted(feats))


OPS: Dict[str, Tuple[Callable, Callable]] = {
    "nms": (nms_inputs, nms_call),
    "batched_nms": (batched_nms_inputs, batched_nms_call),
    "nms_padded": (nms_padded_inputs, nms_padded_call),
    "roi_align": (roi_inputs, roi_align_call),
    "roi_align_channels_last": (lambda seed, device: roi_inputs(seed, device, True), roi_align_call),
    "roi_pool": (roi_inputs, roi_pool_call),
    "roi_pool_channels_last": (lambda seed, device: roi_inputs(seed, device, True), roi_pool_call),
    "MultiScaleRoIAlign": (msra_inputs, msra_call),
}


# --- running ------------------------------------------------------------------------------------


def concurrently(work: List[Callable[[], object]], during: Callable[[threading.Event], None] = None) -> List[object]:
    """Runs each callable of `work` in a thread of its own, all released together, REPEATS
    times each; returns each thread's list of results. `during(stop)`, if given, runs in one
    more thread until every worker is done."""
    barrier = threading.Barrier(len(work) + (1 if during else 0))
    stop = threading.Event()

    def worker(fn):
        barrier.wait()
        return [fn() for _ in range(REPEATS)]

    def side():
        barrier.wait()
        during(stop)

    with ThreadPoolExecutor(len(work) + 1) as pool:
        side_future = pool.submit(side) if during else None
        futures = [pool.submit(worker, fn) for fn in work]
        results = [f.result() for f in futures]
        stop.set()
        if side_future is not None:
            side_future.result()
    return results


def assert_same_bits(serial, runs, what):
    for thread, (want, got_runs) in enumerate(zip(serial, runs)):
        for rep, got in enumerate(got_runs):
            assert len(got) == len(want)
            for j, (g, w) in enumerate(zip(got, want)):
                assert g.dtype == w.dtype and g.shape == w.shape, (what, thread, rep, j)
                assert torch.equal(g, w), f"{what}: thread {thread}, call {rep}, output {j} differs from the serial call"


def check_threads(op, device="cpu", during=None):
    make, call = OPS[op]
    inputs = [make(seed, device) for seed in range(THREADS)]
    serial = [call(*inp) for inp in inputs]
    runs = concurrently([lambda inp=inp: call(*inp) for inp in inputs], during)
    assert_same_bits(serial, runs, op)


@pytest.fixture
def output_cache():
    """The CPU output cache emptied and turned on with 64 MiB; set back afterwards."""
    previous = _C._set_cpu_output_cache(0)
    _C._set_cpu_output_cache(64 << 20)
    try:
        yield
    finally:
        _C._set_cpu_output_cache(0)
        _C._set_cpu_output_cache(previous)


@pytest.mark.parametrize("op", list(OPS))
def test_threads_cpu(op):
    check_threads(op)


@pytest.mark.parametrize("op", list(OPS))
def test_threads_cpu_with_output_cache(op, output_cache):
    check_threads(op)
    assert _C._cpu_output_cache_bytes() <= 64 << 20


CPU_VECTORS = ["auto", "avx512", "avx2", "sse2", "scalar"]


@pytest.mark.parametrize("choice", CPU_VECTORS)
def test_threads_cpu_vector(choice):
    # the setting is process-wide: every thread's calls use it
    with _utils.cpu_vector(choice):
        check_threads("roi_pool")


def test_threads_cpu_vector_switched_mid_run(output_cache):
    # the paths give the same bits, so a setting switched by another thread while calls run
    # (each call reads it once) changes no result
    def switch(stop):
        i = 0
        while not stop.is_set():
            _C._set_cpu_vector(CPU_VECTORS[i % len(CPU_VECTORS)])
            i += 1

    previous = _C._set_cpu_vector("auto")
    try:
        check_threads("roi_pool", during=switch)
    finally:
        _C._set_cpu_vector(previous)


def test_threads_cpu_output_cache_switched_mid_run():
    # the limit changed (and the kept buffers given back) while calls run
    def switch(stop):
        i = 0
        while not stop.is_set():
            _C._set_cpu_output_cache((i % 3) * (16 << 20))
            i += 1

    previous = _C._set_cpu_output_cache(0)
    try:
        check_threads("roi_align", during=switch)
    finally:
        _C._set_cpu_output_cache(0)
        _C._set_cpu_output_cache(previous)


# --- CUDA streams -------------------------------------------------------------------------------


def roi_kernel_choices():
    """The roi_kernel settings this build accepts."""
    choices = []
    for name in ("auto", "band", "gather", "tiled", "generic"):
        try:
            with _utils.roi_kernel(name):
                choices.append(name)
        except (RuntimeError, ValueError):
            pass
    return choices


def check_streams(op, train=False):
    """Each stream's calls from a host thread of its own, and all streams' calls queued from one
    host thread, against serial calls on the default stream."""
    make, call = OPS[op]
    if op == "MultiScaleRoIAlign":
        call = lambda feats, boxes: msra_call(feats, boxes, train)  # noqa: E731
    inputs = [make(seed, "cuda") for seed in range(STREAMS)]
    serial = [call(*inp) for inp in inputs]
    torch.cuda.synchronize()
    streams = [torch.cuda.Stream() for _ in range(STREAMS)]

    def on_stream(i):
        def fn():
            with torch.cuda.stream(streams[i]):
                out = call(*inputs[i])
            streams[i].synchronize()
            return out

        return fn

    assert_same_bits(serial, concurrently([on_stream(i) for i in range(STREAMS)]), f"{op} on streams (threads)")
    runs = [[] for _ in range(STREAMS)]
    for _ in range(REPEATS):
        outs = []
        for i, s in enumerate(streams):
            with torch.cuda.stream(s):
                outs.append(call(*inputs[i]))
        torch.cuda.synchronize()
        for i, out in enumerate(outs):
            runs[i].append(out)
    assert_same_bits(serial, runs, f"{op} on streams (one thread)")


@pytest.mark.cuda
@pytest.mark.parametrize("op", ["nms", "batched_nms", "nms_padded"])
def test_streams_cuda_nms(op):
    nms_kernel = getattr(_utils, "nms_kernel", None)
    if nms_kernel is None:
        check_streams(op)
        return
    for rank in ("auto", "count", "radix", "sort"):
        for pass_ in ("auto", "block", "dataflow"):
            with nms_kernel(rank=rank, pass_=pass_):
                check_streams(op)


@pytest.mark.cuda
@pytest.mark.parametrize("op", ["roi_align", "roi_align_channels_last", "roi_pool", "roi_pool_channels_last"])
def test_streams_cuda_roi(op):
    # bitwise backwards need the deterministic kernels; the setting is process-wide
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        for choice in roi_kernel_choices():
            with _utils.roi_kernel(choice):
                check_streams(op)
    finally:
        torch.use_deterministic_algorithms(previous)


@pytest.mark.cuda
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_streams_cuda_multiscale(train):
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        check_streams("MultiScaleRoIAlign", train)
    finally:
        torch.use_deterministic_algorithms(previous)
