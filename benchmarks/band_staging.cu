// Staging microbenchmark for the float32 roi_align band forward (roi_align_band.cu): ways of
// copying a band of NCHW float32 planes into shared memory, timed apart from the kernel.
//
// Each block stages one band as roi_align_band_forward_rotated_kernel does on the benchmark
// inputs (23 rows x 304 pixels of 8 channels of a 2x256x200x304 map, 225 KB, one 1024-thread
// block per SM, 2 x 14 bands x 32 channel groups), then waits `spin` clock cycles in place of
// the computation (18000: about 9 µs, the kernel's median per block at 7x7) and, with `ahead`,
// asks L2 for the band of the block `ahead` blocks later, as the kernel does. Printed per
// method: the kernel's median time (CUDA events, 10 runs after 2 of warm-up, L2 flushed before
// each run) and the spread of each block's staging time (SM clock at 1.98 GHz). Methods that
// fill the kernel's layout (a staged pixel holds the 8 channels, 32 bytes) are compared with
// the first one element by element ("bad": differing elements of one band); the planar ones
// (each staged row holding 8 channel rows one after the other) only time the copy.
//
//   nvcc -O3 -arch=sm_90 -o /tmp/band_staging benchmarks/band_staging.cu && /tmp/band_staging
//
// BENCHMARKS.md, "roi_align band forward: where a block's time goes".
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>
#define CK(x)                                                      \
  do {                                                             \
    cudaError_t e = (x);                                           \
    if (e != cudaSuccess) {                                        \
      printf("err %s line %d\n", cudaGetErrorString(e), __LINE__); \
      exit(1);                                                     \
    }                                                              \
  } while (0)
constexpr int B = 2, C = 256, H = 200, W = 304, ROWS = 23, CORE = 15, BANDS = 14, STRIDE = 306, G = 32;
struct alignas(16) F4 {
  float v[4];
};
__device__ __forceinline__ unsigned long long gt() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__global__ void __launch_bounds__(1024) stage_kernel(const float* __restrict__ in, int mode, int spin,
                                                     int ahead, long long* rec, float* sink, float* dump) {
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ __align__(8) unsigned long long mbar;
  const int key = blockIdx.x, grp = blockIdx.y;
  const int b = key / BANDS, band = key % BANDS;
  const int r0 = band * CORE, nrows = min(ROWS, H - r0);
  const long long plane = (long long)H * W;
  const float* base = in + ((long long)b * C + grp * 8) * plane + (long long)r0 * W;
  long long t0 = clock64();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (mode == 0 || mode == 4) {  // warp per row, lane per half pixel (4 LDG.32, 1 STS.128), unroll 2 or 4
    const int half = lane & 1;
    for (int r = warp; r < nrows; r += 32) {
      F4* dst = reinterpret_cast<F4*>(smem) + (long long)r * STRIDE * 2 + half;
      const float* src = base + (long long)r * W + half * 4 * plane;
      if (mode == 0) {
#pragma unroll 2
        for (int x = lane >> 1; x < W; x += 16) {
          F4 v;
          for (int j = 0; j < 4; ++j) v.v[j] = src[j * plane + x];
          dst[2 * x] = v;
        }
      } else {
#pragma unroll 4
        for (int x = lane >> 1; x < W; x += 16) {
          F4 v;
          for (int j = 0; j < 4; ++j) v.v[j] = src[j * plane + x];
          dst[2 * x] = v;
        }
      }
    }
  } else if (mode == 1) {  // items (row, x, half) over all threads, 3 in flight
    const int items = nrows * W * 2;
    for (int i0 = threadIdx.x; i0 < items; i0 += 3 * 1024) {
      F4 v[3];
      int dsti[3];
#pragma unroll
      for (int u = 0; u < 3; ++u) {
        int i = i0 + u * 1024;
        dsti[u] = -1;
        if (i < items) {
          int half = i & 1, p = i >> 1, r = p / W, x = p - r * W;
          const float* src = base + (long long)r * W + x + half * 4 * plane;
          for (int j = 0; j < 4; ++j) v[u].v[j] = src[j * plane];
          dsti[u] = (r * STRIDE + x) * 2 + half;
        }
      }
#pragma unroll
      for (int u = 0; u < 3; ++u)
        if (dsti[u] >= 0) reinterpret_cast<F4*>(smem)[dsti[u]] = v[u];
    }
  } else if (mode == 2) {  // TMA bulk copies, planar: row r slot holds 8 channel rows
    uint32_t mb = (uint32_t)__cvta_generic_to_shared(&mbar);
    if (threadIdx.x == 0) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(mb));
      asm volatile("fence.mbarrier_init.release.cluster;");
      asm volatile("fence.proxy.async.shared::cta;");
    }
    __syncthreads();
    if (warp == 0) {
      const uint32_t bytes = W * 4;
      if (lane == 0)
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(mb),
                     "r"(bytes * 8 * nrows)
                     : "memory");
      __syncwarp();
      for (int i = lane; i < 8 * nrows; i += 32) {
        int r = i >> 3, c = i & 7;
        uint32_t dst = (uint32_t)__cvta_generic_to_shared(smem) + r * STRIDE * 32 + c * bytes;
        const float* src = base + c * plane + (long long)r * W;
        asm volatile(
            "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                dst),
            "l"(src), "r"(bytes), "r"(mb)
            : "memory");
      }
    }
    uint32_t done = 0;
    while (!done)
      asm volatile(
          "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], 0; selp.u32 %0, 1, 0, p; }"
          : "=r"(done)
          : "r"(mb)
          : "memory");
  } else if (mode == 5 ||
             mode == 6) {  // cp.async 4 B into the interleaved layout: lane = (x in 0..3, channel 0..7)
    const int xi = lane & 3, ch = lane >> 2;
    const uint32_t sbase = (uint32_t)__cvta_generic_to_shared(smem) + ch * 4 + xi * 32;
    const float* gbase = base + ch * plane + xi;
    const int per_row = W / 4;
    for (int it = warp; it < nrows * per_row; it += 32) {
      const int r = it / per_row, x0 = (it - r * per_row) * 4;
      const uint32_t dst = sbase + (r * STRIDE + x0) * 32;
      const float* src = gbase + (long long)r * W + x0;
      if (mode == 5)
        asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(dst), "l"(src) : "memory");
      else {  // LDG + STS, 4 in flight
        reinterpret_cast<float*>(smem)[(dst - (uint32_t)__cvta_generic_to_shared(smem)) / 4] = __ldg(src);
      }
    }
    if (mode == 5) asm volatile("cp.async.wait_all;" ::: "memory");
  } else if (mode >= 7 && mode <= 9) {  // LDG.128: lane (oct, c) loads channel c, 4 pixels; 7: planar store,
                                        // 8/9: quad transpose -> interleaved
    const int oct = lane >> 3, c = lane & 7, h = c >> 2, rr = c & 3;
    const int per_row = W / 16;  // warp iterations per row (16 pixels each)
    const int total = nrows * per_row;
    const int U = mode == 9 ? 2 : 4;
    for (int it0 = warp; it0 < total; it0 += 32 * U) {
      F4 v[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int it = it0 + 32 * u;
        if (u < U && it < total) {
          const int r = it / per_row, x0 = (it - r * per_row) * 16 + 4 * oct;
          v[u] = *reinterpret_cast<const F4*>(base + c * plane + (long long)r * W + x0);
        }
      }
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int it = it0 + 32 * u;
        if (u < U && it < total) {
          const int r = it / per_row, x0 = (it - r * per_row) * 16 + 4 * oct;
          if (mode == 7) {
            reinterpret_cast<F4*>(smem)[(r * STRIDE * 32 + c * W * 4 + x0 * 4) / 16] = v[u];
          } else {
            float a0 = v[u].v[0], a1 = v[u].v[1], a2 = v[u].v[2], a3 = v[u].v[3];
            bool b = rr & 1;
            float x0s = b ? a0 : a1, x1s = b ? a2 : a3;
            float y0 = __shfl_xor_sync(0xffffffffu, x0s, 1), y1 = __shfl_xor_sync(0xffffffffu, x1s, 1);
            if (b) {
              a0 = y0;
              a2 = y1;
            } else {
              a1 = y0;
              a3 = y1;
            }
            b = rr & 2;
            x0s = b ? a0 : a2;
            x1s = b ? a1 : a3;
            y0 = __shfl_xor_sync(0xffffffffu, x0s, 2);
            y1 = __shfl_xor_sync(0xffffffffu, x1s, 2);
            if (b) {
              a0 = y0;
              a1 = y1;
            } else {
              a2 = y0;
              a3 = y1;
            }
            F4 o;
            o.v[0] = a0;
            o.v[1] = a1;
            o.v[2] = a2;
            o.v[3] = a3;
            reinterpret_cast<F4*>(smem)[(r * STRIDE + x0 + rr) * 2 + h] = o;
          }
        }
      }
    }
  } else if (mode == 10) {  // LDG.128 planar, cp.async16 indexing, 4 in flight
    const int per_row = W / 4;
    const int items = nrows * 8 * per_row;
    for (int i0 = threadIdx.x; i0 < items; i0 += 4 * 1024) {
      F4 v[4];
      int d[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        int i = i0 + u * 1024;
        d[u] = -1;
        if (i < items) {
          int q = i % per_row, rc = i / per_row, c = rc & 7, r = rc >> 3;
          v[u] = *reinterpret_cast<const F4*>(base + c * plane + (long long)r * W + q * 4);
          d[u] = (r * STRIDE * 32 + c * W * 4 + q * 16) / 16;
        }
      }
#pragma unroll
      for (int u = 0; u < 4; ++u)
        if (d[u] >= 0) reinterpret_cast<F4*>(smem)[d[u]] = v[u];
    }
  } else if (mode == 11 ||
             mode == 12) {  // LDG.128 of 8 lanes x 16 B per channel, register rotation, stmatrix rows
    const int rg = lane >> 2, q = lane & 3;  // lane group (4 consecutive pixels), channel in the half
    const int per_row = W / 32;              // 32 pixels per warp instruction and half
    const int rem = W - per_row * 32;        // (304: 9 x 32 + 16) tail handled by mode-0 style below
    const int total = nrows * per_row * 2;   // (row, chunk, half)
    const int U = mode == 11 ? 4 : 2;
    const uint32_t sm0 = (uint32_t)__cvta_generic_to_shared(smem);
    const int j = lane >> 3, rr = lane & 7;  // this lane's stmatrix row address: matrix j, row rr
    for (int it0 = warp; it0 < total; it0 += 32 * U) {
      F4 v[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int it = it0 + 32 * u;
        if (u < U && it < total) {
          const int h = it & 1, rc = it >> 1, r = rc / per_row, x0 = (rc - r * per_row) * 32;
          v[u] = *reinterpret_cast<const F4*>(base + (4 * h + q) * plane + (long long)r * W + x0 + 4 * rg);
        }
      }
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int it = it0 + 32 * u;
        if (u < U && it < total) {
          const int h = it & 1, rc = it >> 1, r = rc / per_row, x0 = (rc - r * per_row) * 32;
          float a0 = v[u].v[0], a1 = v[u].v[1], a2 = v[u].v[2], a3 = v[u].v[3];
          // rotate left by rg & 3: reg k = a[(k + rg) & 3]
          if (rg & 1) {
            float t = a0;
            a0 = a1;
            a1 = a2;
            a2 = a3;
            a3 = t;
          }
          if (rg & 2) {
            float t0 = a0, t1 = a1;
            a0 = a2;
            a1 = a3;
            a2 = t0;
            a3 = t1;
          }
          const uint32_t addr = sm0 + (r * STRIDE * 2 + (x0 + 4 * rr + ((j + rr) & 3)) * 2 + h) * 16;
          asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr),
                       "r"(__float_as_uint(a0)), "r"(__float_as_uint(a1)), "r"(__float_as_uint(a2)),
                       "r"(__float_as_uint(a3))
                       : "memory");
        }
      }
    }
    if (rem > 0) {  // the last rem pixels of each row: a warp per row, lane per half pixel
      const int half = lane & 1;
      for (int r = warp; r < nrows; r += 32) {
        F4* dst = reinterpret_cast<F4*>(smem) + (long long)r * STRIDE * 2 + half;
        const float* src = base + (long long)r * W + half * 4 * plane;
        for (int x = per_row * 32 + (lane >> 1); x < W; x += 16) {
          F4 v;
          for (int jj = 0; jj < 4; ++jj) v.v[jj] = src[jj * plane + x];
          dst[2 * x] = v;
        }
      }
    }
  } else if (mode == 3) {       // cp.async 16 B planar, all threads
    const int per_row = W / 4;  // 16-byte chunks per channel row
    const int items = nrows * 8 * per_row;
    for (int i = threadIdx.x; i < items; i += 1024) {
      int q = i % per_row, rc = i / per_row, c = rc & 7, r = rc >> 3;
      uint32_t dst = (uint32_t)__cvta_generic_to_shared(smem) + r * STRIDE * 32 + c * W * 4 + q * 16;
      const float* src = base + c * plane + (long long)r * W + q * 4;
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
    }
    asm volatile("cp.async.wait_all;" ::: "memory");
  }
  __syncthreads();
  long long t1 = clock64();
  if (dump && blockIdx.x == 3 && blockIdx.y == 5)
    for (int i = threadIdx.x; i < nrows * STRIDE * 8; i += 1024) dump[i] = reinterpret_cast<float*>(smem)[i];
  if (ahead > 0 && threadIdx.x < 8) {  // L2 prefetch of the block `ahead` later
    long long later = blockIdx.x + (long long)blockIdx.y * gridDim.x + ahead;
    int k2 = later % gridDim.x, g2 = later / gridDim.x;
    if (g2 < gridDim.y) {
      int b2 = k2 / BANDS, band2 = k2 % BANDS, rr0 = band2 * CORE, nr2 = min(ROWS, H - rr0);
      const float* f = in + ((long long)b2 * C + g2 * 8 + threadIdx.x) * plane + (long long)rr0 * W;
      asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(f), "r"((uint32_t)(nr2 * W * 4))
                   : "memory");
    }
  }
  // fake compute: spin, then touch smem so it is not dead
  long long s0 = clock64();
  while (clock64() - s0 < spin) {
  }
  float acc = reinterpret_cast<float*>(smem)[(threadIdx.x * 37) % (nrows * STRIDE * 8)];
  if (acc == 12345.f) sink[0] = acc;
  if (threadIdx.x == 0) {
    unsigned s;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
    long long* p = rec + 4 * (blockIdx.x + blockIdx.y * gridDim.x);
    p[0] = s;
    p[1] = t1 - t0;
    p[2] = gt();
    p[3] = 0;
  }
}
int main() {
  size_t n = (size_t)B * C * H * W;
  float* in;
  CK(cudaMalloc(&in, n * 4));
  {
    std::vector<float> hv(n);
    for (size_t i = 0; i < n; ++i) hv[i] = (float)(i % 1000003);
    CK(cudaMemcpy(in, hv.data(), n * 4, cudaMemcpyHostToDevice));
  }
  float* dump;
  CK(cudaMalloc(&dump, ROWS * STRIDE * 32));
  std::vector<float> ref(ROWS * STRIDE * 8), got(ROWS * STRIDE * 8);
  float* sink;
  CK(cudaMalloc(&sink, 4));
  long long* rec;
  const int nb = 2 * BANDS * G;
  CK(cudaMalloc(&rec, nb * 4 * 8));
  char* flush;
  CK(cudaMalloc(&flush, 256 << 20));
  int smem = ROWS * STRIDE * 32;
  CK(cudaFuncSetAttribute(stage_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  cudaDeviceProp pr;
  CK(cudaGetDeviceProperties(&pr, 0));
  printf("%s SMs %d smem %d\n", pr.name, pr.multiProcessorCount, smem);
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  const char* names[] = {"kernel's: warp per row, 4 x 4-byte loads, 16-byte store",  // 0
                         "4-byte loads over all threads, 3 pixels in flight",        // 1
                         "planar: TMA bulk copies of channel rows",                  // 2
                         "planar: cp.async 16 bytes, all in flight",                 // 3
                         "kernel's, 4 iterations in flight",                         // 4
                         "cp.async 4 bytes into the 32-byte pixels",                 // 5
                         "4-byte loads and stores into the 32-byte pixels",          // 6
                         "planar: 16-byte loads, 8 planes x 64 bytes a warp",        // 7
                         "16-byte loads, 4x4 shuffle transpose, 4 in flight",        // 8
                         "16-byte loads, 4x4 shuffle transpose, 2 in flight",        // 9
                         "planar: 16-byte loads, 512 contiguous bytes a warp",       // 10
                         "16-byte loads, stmatrix rows, 4 in flight",                // 11
                         "16-byte loads, stmatrix rows, 2 in flight"};               // 12
  for (int spin : {0, 18000})
    for (int ahead : {0, 99})
      for (int mode = 0; mode <= 12; ++mode) {
        std::vector<float> ts;
        std::vector<long long> h(nb * 4);
        std::vector<double> st;
        for (int it = 0; it < 12; ++it) {
          CK(cudaMemset(flush, it, 256 << 20));
          cudaEventRecord(e0);
          stage_kernel<<<dim3(2 * BANDS, G), 1024, smem>>>(in, mode, spin, ahead, rec, sink,
                                                           it == 0 ? dump : nullptr);
          cudaEventRecord(e1);
          CK(cudaEventSynchronize(e1));
          float ms;
          cudaEventElapsedTime(&ms, e0, e1);
          ts.push_back(ms * 1000);
          if (it >= 2) {
            CK(cudaMemcpy(h.data(), rec, nb * 32, cudaMemcpyDeviceToHost));
            for (int i = 0; i < nb; ++i) st.push_back(h[4 * i + 1] / 1.98e3);
          }
        }
        CK(cudaMemcpy(got.data(), dump, got.size() * 4, cudaMemcpyDeviceToHost));
        if (mode == 0) ref = got;
        long bad = 0;
        if (mode != 2 && mode != 3 && mode != 7 && mode != 10)
          for (int r = 0; r < ROWS; ++r)
            for (int x = 0; x < W * 8; ++x) bad += ref[r * STRIDE * 8 + x] != got[r * STRIDE * 8 + x];
        std::sort(ts.begin() + 2, ts.end());
        std::sort(st.begin(), st.end());
        printf(
            "bad %ld spin %5d ahead %3d %-55s kernel med %7.1f us | staging per block p10 %.2f med %.2f p90 "
            "%.2f us\n",
            bad, spin, ahead, names[mode], ts[2 + (ts.size() - 2) / 2], st[st.size() / 10], st[st.size() / 2],
            st[st.size() * 9 / 10]);
      }
  return 0;
}
