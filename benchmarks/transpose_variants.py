"""Shapes of the CUDA NCHW -> channels_last transpose that `_to_channels_last` runs
(csrc/cuda/to_channels_last.cu), compiled inline side by side, each against a clone and torch's
copy of the same tensor, for float32 and bfloat16 maps.

A variant is (K values a lane, R rows of 32 threads a block, at least N blocks an SM in
`__launch_bounds__`); the kernel template is the library's, taken from its source file. Each
variant's output is checked against torch's before it is timed; times are queued (the median
over 15 rounds of 20 calls between two events, divided by 20, in µs). The library runs the
fastest ("BENCHMARKS.md", "CUDA channels_last gradients"). Needs nvcc and ninja
(torch.utils.cpp_extension.load_inline).

    python -m benchmarks.transpose_variants
"""
from __future__ import annotations

import pathlib

import torch
from torch.utils.cpp_extension import load_inline

from benchmarks.channels_last_grad import timer  # importing it loads detops and its ops

# (K, R, N) for 4-byte and for 2-byte values; N = 1 sets no minimum
VARIANTS = {
    4: [(1, 8, 1), (2, 8, 1), (2, 8, 4), (2, 16, 1), (2, 16, 2), (2, 4, 1), (1, 16, 1), (1, 4, 1)],
    2: [(1, 8, 1), (4, 8, 1), (4, 8, 4), (4, 16, 1), (4, 16, 2), (2, 8, 1), (2, 8, 4), (2, 16, 1)],
}
MAPS = ((2, 256, 200, 304), (8, 256, 200, 304), (2, 256, 100, 152))

ROOT = pathlib.Path(__file__).resolve().parents[1]
LIBRARY = ROOT / "csrc" / "cuda" / "to_channels_last.cu"
# the library's kernel: from its first constant to the launcher (nchw_to_nhwc_kernel)
KERNEL_START = "constexpr int kLanes = 32;"
KERNEL_END = "template <typename Bits, int K, int Rows, int MinBlocks>\nvoid launch_transpose"


def library_kernel() -> str:
    """The text of the library's transpose kernel template, taken from its source file."""
    text = LIBRARY.read_text()
    start, end = text.index(KERNEL_START), text.index(KERNEL_END)
    return text[start:end]


SOURCE = r"""
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <torch/extension.h>

@KERNEL@
template <typename Bits, int K, int Rows, int MinBlocks>
void launch(const at::Tensor& x, at::Tensor& y) {
  constexpr int T = kLanes * K;
  const int64_t B = x.size(0), C = x.size(1), P = x.size(2) * x.size(3);
  TORCH_CHECK(P % K == 0 && C % K == 0 && B <= 65535);
  const dim3 grid((P + T - 1) / T, (C + T - 1) / T, B);
  nchw_to_nhwc_kernel<Bits, K, Rows, MinBlocks><<<grid, dim3(kLanes, Rows), 0, at::cuda::getCurrentCUDAStream()>>>(
      static_cast<const Bits*>(x.const_data_ptr()), static_cast<Bits*>(y.mutable_data_ptr()), B, C, P);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void run(at::Tensor x, at::Tensor y, int64_t variant) {
  TORCH_CHECK(x.is_contiguous() && y.is_contiguous(at::MemoryFormat::ChannelsLast));
  if (x.element_size() == 4) {
    using B = uint32_t;
    switch (variant) {
      @FOUR@
    }
  } else {
    TORCH_CHECK(x.element_size() == 2);
    using B = uint16_t;
    switch (variant) {
      @TWO@
    }
  }
}
"""


def source() -> str:
    """The inline extension: the library's kernel, a launcher and a switch over the variants."""
    return SOURCE.replace("@KERNEL@", library_kernel()).replace("@FOUR@", cases(4)).replace("@TWO@", cases(2))


def cases(size: int) -> str:
    return "\n      ".join(
        f"case {i}: launch<B, {k}, {r}, {n}>(x, y); break;" for i, (k, r, n) in enumerate(VARIANTS[size]))


def name(k: int, r: int, n: int) -> str:
    return f"K{k} R{r}" + (f" lb {n}" if n > 1 else "")


def main() -> None:
    module = load_inline(
        "detops_transpose_variants", cpp_sources="void run(at::Tensor x, at::Tensor y, int64_t variant);",
        cuda_sources=source(), functions=["run"],
        extra_cflags=["-O3", "-std=c++20"], extra_cuda_cflags=["-O3", "-std=c++20"])
    queued_us = timer("cuda", calls=20, rounds=15)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}; µs, queued")
    for dtype in (torch.float32, torch.bfloat16):
        for shape in MAPS:
            x = torch.randn(shape, device="cuda").to(dtype)
            want = x.contiguous(memory_format=torch.channels_last)
            y = torch.empty_like(want)
            row = [f"clone {queued_us(lambda: x.clone()):6.1f}",
                   f"torch {queued_us(lambda: x.contiguous(memory_format=torch.channels_last)):6.1f}"]
            for i, variant in enumerate(VARIANTS[x.element_size()]):
                y.zero_()
                module.run(x, y, i)
                assert torch.equal(y, want), name(*variant)
                row.append(f"{name(*variant)} {queued_us(lambda: module.run(x, y, i)):6.1f}")
            row.append(f"_to_channels_last {queued_us(lambda: torch.ops.detops._to_channels_last(x)):6.1f}")
            print(str(dtype).replace("torch.", ""), "x".join(map(str, shape)), " | ".join(row), flush=True)


if __name__ == "__main__":
    main()
