// A CPU driver of every detops op for the AddressSanitizer + UndefinedBehaviorSanitizer build
// (DETOPS_SANITIZE=ON, tools/sanitize_cpu.sh): it calls each op of <detops/detops.h>,
// _to_channels_last and each C ABI entry on every path the CPU kernels can take, so that a
// read or write outside a buffer, a use after free or undefined behaviour on any of them is
// reported. Paths: every dtype, NCHW / channels_last / strided inputs, empty and odd shapes,
// forward and backward (direct and through autograd), autocast, 1 and 2 threads, the output
// cache off and on (with outputs large enough to take it and to ask for huge pages), the
// deterministic-algorithms flag, each cpu_vector choice for roi_pool's float32 forward, NMS
// segment sizes that take the dense, window and grid passes, and inputs the ops must reject
// (each must throw c10::Error, not crash).
//
// Besides the sanitizers' own checks it asserts a few invariants that every path must keep
// (roi_pool's paths give the same bits, the results do not depend on the thread count), and
// exits 1 when one fails or an op throws where it should not.
//
//   detops_sanitize_driver [--quick]   (--quick, or DETOPS_SANITIZE_QUICK=1: without the last
//                                       pass of settings)
#include <detops/detops.h>
#include <detops/detops_aot.h>

#include "aot_call.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "common/kernel_choice.h"
#include "cpu/output_cache.h"

namespace {

using detops::ops::CpuVector;

int failures = 0;
int64_t calls = 0;

void fail(const std::string& what) {
  ++failures;
  std::fprintf(stderr, "FAIL: %s\n", what.c_str());
}

const double kNaN = std::numeric_limits<double>::quiet_NaN();
const double kInf = std::numeric_limits<double>::infinity();

const at::ScalarType kDtypes[] = {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16};

// The process-wide settings one pass of the driver runs under.
struct Setting {
  int threads;
  size_t cache_bytes;  // 0: output cache off
  bool deterministic;
  std::string name() const {
    return "threads=" + std::to_string(threads) + " cache=" + (cache_bytes ? "on" : "off") +
        (deterministic ? " deterministic" : "");
  }
};

class Apply {
 public:
  explicit Apply(const Setting& s)
      : threads_(at::get_num_threads()),
        deterministic_(at::globalContext().deterministicAlgorithms()) {
    at::set_num_threads(s.threads);
    detops::cpu::OutputCache::get().set_limit(s.cache_bytes);
    at::globalContext().setDeterministicAlgorithms(s.deterministic, false);
  }
  ~Apply() {
    at::set_num_threads(threads_);
    detops::cpu::OutputCache::get().set_limit(0);
    at::globalContext().setDeterministicAlgorithms(deterministic_, false);
  }

 private:
  int threads_;
  bool deterministic_;
};

// Runs f, which must not throw.
template <typename F>
void run(const std::string& what, F&& f) {
  ++calls;
  try {
    f();
  } catch (const std::exception& e) {
    fail(what + ": unexpected exception: " + e.what());
  }
}

// Runs f, which may throw c10::Error (inputs an op may reject or take, as it documents).
template <typename F>
void may_reject(const std::string& what, F&& f) {
  ++calls;
  try {
    f();
  } catch (const c10::Error&) {
  } catch (const std::exception& e) {
    fail(what + ": threw a non-c10 exception: " + e.what());
  }
}

// Runs f, which must throw c10::Error (an op rejecting its inputs).
template <typename F>
void rejects(const std::string& what, F&& f) {
  ++calls;
  try {
    f();
  } catch (const c10::Error&) {
    return;
  } catch (const std::exception& e) {
    fail(what + ": threw a non-c10 exception: " + e.what());
    return;
  }
  fail(what + ": accepted inputs it must reject");
}

void same(const std::string& what, const at::Tensor& a, const at::Tensor& b) {
  if (a.sizes() != b.sizes() || a.scalar_type() != b.scalar_type() ||
      !at::equal(at::nan_to_num(a.to(at::kDouble), 12345.0), at::nan_to_num(b.to(at::kDouble), 12345.0))) {
    fail(what + ": results differ");
  }
}

// ---- inputs ------------------------------------------------------------------------------

// [k, 5] RoIs of images [0, batch) on an h x w map (image coordinates = map / scale), of every
// kind the kernels must take: inside the map, partly and wholly outside, huge, tiny, zero-size,
// reversed (x2 < x1), on the edges, and identical.
at::Tensor make_rois(int64_t k, int64_t batch, int64_t h, int64_t w, double scale, at::ScalarType dtype) {
  std::vector<double> v;
  v.reserve(k * 5);
  for (int64_t i = 0; i < k; ++i) {
    const double b = static_cast<double>(i % std::max<int64_t>(batch, 1));
    const double fx = static_cast<double>((i * 37) % 101) / 100.0, fy = static_cast<double>((i * 53) % 97) / 96.0;
    double x1 = fx * w, y1 = fy * h, x2 = x1 + 1 + (i % 7) * w / 5.0, y2 = y1 + 1 + (i % 5) * h / 4.0;
    switch (i % 10) {
      case 0: x1 = -0.5 * w; y1 = -2; break;                   // partly outside
      case 1: x1 += 2 * w; x2 += 2 * w; break;                 // wholly outside
      case 2: x1 = -1e5; y1 = -1e5; x2 = 1e5; y2 = 1e5; break;  // huge
      case 3: x2 = x1; y2 = y1; break;                         // zero-size
      case 4: std::swap(x1, x2); break;                        // reversed
      case 5: x1 = 0; y1 = 0; x2 = w - 1; y2 = h - 1; break;   // the whole map
      case 6: x1 = w - 0.25; y1 = h - 0.25; x2 = w; y2 = h; break;  // on the far edge
      case 7: x2 = x1 + 0.01; y2 = y1 + 0.01; break;           // tiny
      default: break;
    }
    for (double c : {b, x1 / scale, y1 / scale, x2 / scale, y2 / scale}) v.push_back(c);
  }
  return at::tensor(v, at::kDouble).view({k, 5}).to(dtype);
}

// [n, 4] boxes with scores: clusters of overlapping boxes, identical boxes, equal scores,
// degenerate and reversed boxes, non-finite coordinates and NaN scores.
std::pair<at::Tensor, at::Tensor> make_boxes(int64_t n, at::ScalarType dtype, bool non_finite) {
  at::Tensor xy = at::rand({n, 2}, at::kDouble) * 200;
  at::Tensor wh = at::rand({n, 2}, at::kDouble) * 30 + 0.5;
  at::Tensor boxes = at::cat({xy, xy + wh}, 1);
  at::Tensor scores = at::rand({n}, at::kDouble);
  auto b = boxes.accessor<double, 2>();
  auto s = scores.accessor<double, 1>();
  for (int64_t i = 0; i < n; ++i) {
    switch (i % 16) {
      case 1: if (i > 0) for (int j = 0; j < 4; ++j) b[i][j] = b[i - 1][j]; break;  // identical
      case 2: if (i > 0) s[i] = s[i - 1]; break;                                    // equal score
      case 3: b[i][2] = b[i][0]; break;                                              // zero width
      case 4: std::swap(b[i][0], b[i][2]); break;                                    // reversed
      case 5: b[i][0] = -1e6; b[i][2] = 1e6; break;                                  // huge
      case 6: if (non_finite) b[i][1] = kNaN; break;
      case 7: if (non_finite) b[i][3] = kInf; break;
      case 8: if (non_finite) s[i] = kNaN; break;
      case 9: if (non_finite) { b[i][0] = -kInf; b[i][2] = kInf; } break;
      default: break;
    }
  }
  return {boxes.to(dtype), scores.to(dtype)};
}

// x in the layout asked for: 0 NCHW contiguous, 1 channels_last, 2 strided (every other column
// of a wider map), 3 channels_last with every other row.
at::Tensor in_layout(const at::Tensor& x, int layout) {
  if (layout == 1) return x.contiguous(at::MemoryFormat::ChannelsLast);
  if (layout == 2 || layout == 3) {
    const int dim = layout == 2 ? 3 : 2;
    std::vector<int64_t> wide(x.sizes().begin(), x.sizes().end());
    wide[dim] *= 2;
    at::Tensor base = at::zeros(wide, x.options());
    if (layout == 3) base = base.contiguous(at::MemoryFormat::ChannelsLast);
    at::Tensor view = base.slice(dim, 0, wide[dim], 2);
    view.copy_(x);
    return view;
  }
  return x.contiguous();
}

at::Tensor to_channels_last(const at::Tensor& x) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("detops::_to_channels_last", "")
                       .typed<at::Tensor(const at::Tensor&)>();
  return op.call(x);
}

// ---- NMS ---------------------------------------------------------------------------------

// Sizes that take each pass: < 48 boxes dense, 48 .. 1023 the window, 1024+ the grid (in blocks
// of 1024 on several threads).
const int64_t kNmsSizes[] = {0, 1, 5, 47, 48, 300, 1024, 2600};

void nms_cases() {
  for (at::ScalarType dt : kDtypes) {
    for (int64_t n : kNmsSizes) {
      for (bool nf : {false, true}) {
        auto [boxes, scores] = make_boxes(n, dt, nf);
        for (double thr : {-0.5, 0.0, 0.5, 1.0}) {
          const std::string what = "nms n=" + std::to_string(n) + " " + c10::toString(dt);
          run(what, [&] { detops::ops::nms(boxes, scores, thr); });
          // non-contiguous boxes and scores, scores of another dtype
          run(what + " strided", [&] {
            const at::Tensor bt = boxes.t().contiguous().t();
            const at::Tensor other = scores.to(dt == at::kFloat ? at::kDouble : at::kFloat);
            detops::ops::nms(bt, at::stack({other, other}, 1).select(1, 0), thr);
          });
        }
        // categories: one long enough for the grid, one for the window, many small ones,
        // negative and large ids, int32 ids
        at::Tensor idxs = at::empty({n}, at::kLong);
        auto id = idxs.accessor<int64_t, 1>();
        for (int64_t i = 0; i < n; ++i) {
          id[i] = i < 1100 ? 0 : i < 1400 ? -3 : (i % 3 == 0 ? int64_t{1} << 40 : i % 97);
        }
        for (at::ScalarType it : {at::kLong, at::kInt}) {
          run("batched_nms n=" + std::to_string(n), [&] {
            detops::ops::batched_nms(boxes, scores, idxs.to(it), 0.5);
          });
        }
      }
    }
  }
}

void nms_padded_cases() {
  for (at::ScalarType dt : kDtypes) {
    for (int64_t b : {0, 1, 3}) {
      for (int64_t n : {0, 1, 7, 300}) {
        std::vector<at::Tensor> bs, ss;
        for (int64_t i = 0; i < b; ++i) {
          auto [bx, sc] = make_boxes(n, dt, i % 2 == 1);
          bs.push_back(bx);
          ss.push_back(sc);
        }
        at::Tensor boxes = b ? at::stack(bs) : at::zeros({0, n, 4}, dt);
        at::Tensor scores = b ? at::stack(ss) : at::zeros({0, n}, dt);
        for (int64_t max_output : {0, 1, 5, 1000}) {
          for (double sthr : {-kInf, 0.5, 2.0}) {
            for (double thr : {-0.1, 0.0, 0.7}) {
              run("nms_padded", [&] {
                auto [idx, count] = detops::ops::nms_padded(boxes, scores, thr, sthr, max_output);
                if (idx.size(0) != b || idx.size(1) != max_output || count.size(0) != b) {
                  fail("nms_padded: wrong output shape");
                }
              });
            }
          }
        }
        // scores of another dtype, strided boxes
        run("nms_padded mixed", [&] {
          detops::ops::nms_padded(
              boxes.transpose(1, 2).contiguous().transpose(1, 2), scores.to(at::kDouble), 0.5, -kInf, 10);
        });
      }
    }
  }
}

void nms_rejects() {
  auto [boxes, scores] = make_boxes(10, at::kFloat, false);
  rejects("nms NaN threshold", [&] { detops::ops::nms(boxes, scores, kNaN); });
  rejects("nms boxes [N, 5]", [&] { detops::ops::nms(at::zeros({10, 5}), scores, 0.5); });
  rejects("nms int boxes", [&] { detops::ops::nms(boxes.to(at::kInt), scores, 0.5); });
  rejects("nms bool scores", [&] { detops::ops::nms(boxes, scores.to(at::kBool), 0.5); });
  rejects("nms fewer scores", [&] { detops::ops::nms(boxes, scores.narrow(0, 0, 9), 0.5); });
  rejects("batched_nms float idxs", [&] { detops::ops::batched_nms(boxes, scores, scores, 0.5); });
  rejects("batched_nms idxs [N, 1]", [&] {
    detops::ops::batched_nms(boxes, scores, at::zeros({10, 1}, at::kLong), 0.5);
  });
  rejects("nms_padded negative max_output", [&] {
    detops::ops::nms_padded(boxes.unsqueeze(0), scores.unsqueeze(0), 0.5, 0.0, -1);
  });
  rejects("nms_padded NaN threshold", [&] {
    detops::ops::nms_padded(boxes.unsqueeze(0), scores.unsqueeze(0), kNaN, 0.0, 5);
  });
  rejects("nms_padded rank 2 boxes", [&] { detops::ops::nms_padded(boxes, scores, 0.5, 0.0, 5); });
}

// ---- RoIAlign ----------------------------------------------------------------------------

struct RoIShape {
  int64_t b, c, h, w, k, ph, pw;
};

// Odd and empty shapes; channel counts below, at and past the kernels' blocks (8 NCHW, 32
// channels_last); maps of 1 pixel and maps tall enough for the backward's bands of rows.
const RoIShape kRoIShapes[] = {
    {1, 1, 1, 1, 3, 1, 1},   {2, 3, 5, 7, 11, 2, 3}, {2, 8, 13, 9, 10, 7, 7},
    {1, 9, 6, 6, 4, 3, 2},   {3, 33, 10, 12, 13, 2, 2}, {1, 1, 40, 24, 9, 5, 5},
    {2, 40, 17, 20, 20, 3, 3}, {1, 4, 9, 9, 0, 2, 2},  {0, 4, 9, 9, 0, 2, 2},
    {2, 0, 9, 9, 5, 2, 2},   {1, 3, 0, 5, 4, 2, 2},
};

// (sampling_ratio, aligned, spatial_scale) of the roi_align calls: a fixed grid and the
// adaptive one (0, and -1 which the op also takes as adaptive), both alignments, two scales.
struct AlignArgs {
  int64_t sampling_ratio;
  bool aligned;
  double scale;
};
const AlignArgs kAlignArgs[] = {{0, true, 1.0}, {2, false, 0.25}, {-1, true, 1.0}, {1, false, 1.0}};

void roi_align_cases(bool all_layouts) {
  for (at::ScalarType dt : kDtypes) {
    for (const RoIShape& s : kRoIShapes) {
      const at::Tensor x0 = at::randn({s.b, s.c, s.h, s.w}, at::kDouble).to(dt);
      for (int layout = 0; layout < (all_layouts ? 4 : 2); ++layout) {
        const at::Tensor x = in_layout(x0, layout);
        for (const AlignArgs& a : kAlignArgs) {
          const at::Tensor rois = make_rois(s.k, s.b, s.h, s.w, a.scale, dt);
          const std::string what = "roi_align " + std::string(c10::toString(dt)) + " c=" +
              std::to_string(s.c) + " k=" + std::to_string(s.k) + " layout=" + std::to_string(layout);
          run(what, [&] {
            at::Tensor out = detops::ops::roi_align(x, rois, a.scale, s.ph, s.pw, a.sampling_ratio, a.aligned);
            at::Tensor g = at::randn_like(out);
            detops::ops::roi_align_backward(
                g, rois, a.scale, s.ph, s.pw, s.b, s.c, s.h, s.w, a.sampling_ratio, a.aligned);
            // a strided gradient
            detops::ops::roi_align_backward(
                at::cat({g, g}, 3).slice(3, 0, 2 * s.pw, 2), rois, a.scale, s.ph, s.pw, s.b, s.c,
                s.h, s.w, a.sampling_ratio, a.aligned);
          });
        }
        run("roi_align autograd, layout " + std::to_string(layout), [&] {
          const at::Tensor rois = make_rois(s.k, s.b, s.h, s.w, 1.0, dt);
          at::Tensor xg = x.detach().requires_grad_(true);  // in x's layout
          at::Tensor out = detops::ops::roi_align(xg, rois, 1.0, s.ph, s.pw, 0, true);
          out.backward(at::ones_like(out));
        });
      }
    }
  }
  // RoIs of an adaptive grid so large that their sample tables pass the 64 MiB the kernels
  // share: each task builds its own
  run("roi_align huge adaptive grids", [&] {
    at::Tensor x = at::randn({1, 2, 8, 8});
    at::Tensor rois = at::tensor({0.0, -1e6, -1e6, 1e6, 1e6}, at::kDouble).view({1, 5}).repeat({24, 1}).to(at::kFloat);
    at::Tensor out = detops::ops::roi_align(x, rois, 1.0, 7, 7, 0, true);
    detops::ops::roi_align_backward(at::ones_like(out), rois, 1.0, 7, 7, 1, 2, 8, 8, 0, true);
  });
}

void roi_align_rejects() {
  const at::Tensor x = at::randn({2, 3, 8, 8});
  const auto bad_rois = [](double b) { return at::tensor({b, 1.0, 1.0, 4.0, 4.0}, at::kDouble).view({1, 5}).to(at::kFloat); };
  for (double b : {2.0, -1.0, 0.5, kNaN, kInf, 1e30}) {
    rejects("roi_align batch index " + std::to_string(b), [&] {
      detops::ops::roi_align(x, bad_rois(b), 1.0, 2, 2, 2, true);
    });
    rejects("roi_align backward batch index " + std::to_string(b), [&] {
      detops::ops::roi_align_backward(at::ones({1, 3, 2, 2}), bad_rois(b), 1.0, 2, 2, 2, 3, 8, 8, 2, true);
    });
  }
  const at::Tensor rois = bad_rois(0);
  rejects("roi_align pooled 0", [&] { detops::ops::roi_align(x, rois, 1.0, 0, 2, 2, true); });
  rejects("roi_align pooled -3", [&] { detops::ops::roi_align(x, rois, 1.0, 2, -3, 2, true); });
  may_reject("roi_align sampling_ratio -2", [&] { detops::ops::roi_align(x, rois, 1.0, 2, 2, -2, true); });
  rejects("roi_align NaN scale", [&] { detops::ops::roi_align(x, rois, kNaN, 2, 2, 2, true); });
  rejects("roi_align rank 3", [&] { detops::ops::roi_align(x[0], rois, 1.0, 2, 2, 2, true); });
  rejects("roi_align int input", [&] { detops::ops::roi_align(x.to(at::kInt), rois, 1.0, 2, 2, 2, true); });
  rejects("roi_align rois [K, 4]", [&] { detops::ops::roi_align(x, rois.narrow(1, 0, 4), 1.0, 2, 2, 2, true); });
  rejects("roi_align backward negative size", [&] {
    detops::ops::roi_align_backward(at::ones({1, 3, 2, 2}), rois, 1.0, 2, 2, 2, 3, -8, 8, 2, true);
  });
  rejects("roi_align backward grad of other channels", [&] {
    detops::ops::roi_align_backward(at::ones({1, 4, 2, 2}), rois, 1.0, 2, 2, 2, 3, 8, 8, 2, true);
  });
}

// ---- RoIPool -----------------------------------------------------------------------------

// roi_pool with argmax, roi_pool_values and both backwards (direct with the forward's argmax,
// and through autograd) on one input; returns (output, argmax).
std::tuple<at::Tensor, at::Tensor> roi_pool_all(
    const std::string& what, const at::Tensor& x, const at::Tensor& rois, double scale,
    const RoIShape& s, bool backward) {
  at::Tensor out, argmax;
  run(what, [&] {
    std::tie(out, argmax) = detops::ops::roi_pool(x, rois, scale, s.ph, s.pw);
    at::Tensor values = detops::ops::roi_pool_values(x, rois, scale, s.ph, s.pw);
    same(what + " values", values, out);
    if (!backward) return;
    at::Tensor g = at::randn_like(out);
    detops::ops::roi_pool_backward(g, rois, argmax, scale, s.ph, s.pw, s.b, s.c, s.h, s.w);
    // strided gradient and argmax
    detops::ops::roi_pool_backward(
        at::cat({g, g}, 2).slice(2, 0, 2 * s.ph, 2), rois, at::cat({argmax, argmax}, 3).slice(3, 0, 2 * s.pw, 2),
        scale, s.ph, s.pw, s.b, s.c, s.h, s.w);
    at::Tensor xg = x.detach().requires_grad_(true);  // in x's layout
    detops::ops::roi_pool_values(xg, rois, scale, s.ph, s.pw).sum().backward();
  });
  return {out, argmax};
}

void roi_pool_cases(bool all_layouts) {
  for (at::ScalarType dt : kDtypes) {
    for (const RoIShape& s : kRoIShapes) {
      const at::Tensor x0 = at::randn({s.b, s.c, s.h, s.w}, at::kDouble).to(dt);
      for (double scale : {1.0, 0.25}) {
        const at::Tensor rois = make_rois(s.k, s.b, s.h, s.w, scale, dt);
        for (int layout = 0; layout < (all_layouts ? 4 : 2); ++layout) {
          roi_pool_all(
              "roi_pool " + std::string(c10::toString(dt)) + " c=" + std::to_string(s.c) +
                  " layout=" + std::to_string(layout),
              in_layout(x0, layout), rois, scale, s, true);
        }
      }
    }
  }
}

// roi_pool's float32 forward under each cpu_vector choice: NCHW rows of 4+ columns and
// channels_last take the vector paths (channel blocks of 8, up to 4 blocks an item, a last
// block moved back), narrower maps and strided ones the scalar path. Every choice must give the
// bits of the scalar code.
void roi_pool_vector_cases() {
  const RoIShape shapes[] = {
      {1, 8, 6, 4, 5, 2, 2}, {2, 9, 7, 13, 9, 3, 3}, {1, 16, 5, 3, 4, 2, 2},
      {2, 33, 9, 11, 12, 7, 7}, {1, 40, 12, 5, 7, 2, 3}, {1, 72, 4, 4, 3, 1, 1},
  };
  for (const RoIShape& s : shapes) {
    const at::Tensor x0 = at::randn({s.b, s.c, s.h, s.w});
    // ties and NaN: the first maximum wins, NaN never does
    x0.select(1, 0).fill_(1.0f);
    x0.select(1, 1).select(1, 0).fill_(static_cast<float>(kNaN));
    const at::Tensor rois = make_rois(s.k, s.b, s.h, s.w, 1.0, at::kFloat);
    for (int layout = 0; layout < 4; ++layout) {
      const at::Tensor x = in_layout(x0, layout);
      at::Tensor want_out, want_arg;
      {
        const CpuVector previous = detops::ops::set_cpu_vector(CpuVector::kScalar);
        std::tie(want_out, want_arg) = roi_pool_all("roi_pool scalar", x, rois, 1.0, s, false);
        detops::ops::set_cpu_vector(previous);
      }
      for (CpuVector v : {CpuVector::kAuto, CpuVector::kSse2, CpuVector::kAvx2, CpuVector::kAvx512}) {
        const CpuVector previous = detops::ops::set_cpu_vector(v);
        const std::string what = "roi_pool cpu_vector=" + std::to_string(static_cast<int>(v)) +
            " c=" + std::to_string(s.c) + " layout=" + std::to_string(layout);
        auto [out, arg] = roi_pool_all(what, x, rois, 1.0, s, v == CpuVector::kAuto);
        same(what + " output", out, want_out);
        same(what + " argmax", arg, want_arg);
        detops::ops::set_cpu_vector(previous);
      }
    }
  }
}

void roi_pool_rejects() {
  const at::Tensor x = at::randn({2, 3, 8, 8});
  const at::Tensor rois = at::tensor({0.0f, 1.0f, 1.0f, 4.0f, 4.0f}).view({1, 5});
  for (float b : {2.0f, -1.0f, 0.5f, static_cast<float>(kNaN), 1e30f}) {
    at::Tensor r = rois.clone();
    r[0][0] = b;
    rejects("roi_pool batch index", [&] { detops::ops::roi_pool(x, r, 1.0, 2, 2); });
    rejects("roi_pool_values batch index", [&] { detops::ops::roi_pool_values(x, r, 1.0, 2, 2); });
  }
  auto [out, argmax] = detops::ops::roi_pool(x, rois, 1.0, 2, 2);
  for (int bad : {64, -2, std::numeric_limits<int>::max(), std::numeric_limits<int>::min()}) {
    at::Tensor a = argmax.clone();
    a[0][1][1][0] = bad;
    rejects("roi_pool backward argmax " + std::to_string(bad), [&] {
      detops::ops::roi_pool_backward(at::ones_like(out), rois, a, 1.0, 2, 2, 2, 3, 8, 8);
    });
  }
  rejects("roi_pool backward long argmax", [&] {
    detops::ops::roi_pool_backward(at::ones_like(out), rois, argmax.to(at::kLong), 1.0, 2, 2, 2, 3, 8, 8);
  });
  rejects("roi_pool backward argmax of another shape", [&] {
    detops::ops::roi_pool_backward(at::ones_like(out), rois, argmax.narrow(3, 0, 1), 1.0, 2, 2, 2, 3, 8, 8);
  });
  rejects("roi_pool pooled 0", [&] { detops::ops::roi_pool(x, rois, 1.0, 2, 0); });
  rejects("roi_pool bool input", [&] { detops::ops::roi_pool(x.to(at::kBool), rois, 1.0, 2, 2); });
  rejects("roi_pool rois of another dtype", [&] { detops::ops::roi_pool(x, rois.to(at::kDouble), 1.0, 2, 2); });
  rejects("roi_pool inf scale", [&] { detops::ops::roi_pool(x, rois, kInf, 2, 2); });
}

// ---- large outputs: the output cache, huge pages, pages mapped by several threads ---------

void large_cases(bool cache_on) {
  // roi_align's output of 9.6 MB (past the 8 MiB from which outputs ask for huge pages) and its
  // grad_input of 9.3 MB; roi_pool's of 3.2 MB (past the cache's 1 MiB). Twice each, so that with
  // the cache on the second call takes the first one's freed buffers.
  const at::Tensor x = at::randn({1, 48, 220, 220});
  const at::Tensor rois = make_rois(1024, 1, 220, 220, 1.0, at::kFloat);
  for (int rep = 0; rep < (cache_on ? 2 : 1); ++rep) {
    run("large roi_align", [&] {
      at::Tensor xg = x.clone().requires_grad_(true);
      at::Tensor out = detops::ops::roi_align(xg, rois, 1.0, 7, 7, 2, true);
      out.backward(at::ones_like(out));
      at::Tensor xcl = x.contiguous(at::MemoryFormat::ChannelsLast).requires_grad_(true);
      at::Tensor out_cl = detops::ops::roi_align(xcl, rois, 1.0, 7, 7, 2, true);
      out_cl.backward(at::ones_like(out_cl));  // grad_input through _to_channels_last
      same("large roi_align channels_last", out_cl, out);
    });
    run("large roi_pool", [&] {
      at::Tensor xg = x.clone().requires_grad_(true);
      auto [out, argmax] = detops::ops::roi_pool(xg, rois.narrow(0, 0, 340), 1.0, 7, 7);
      out.backward(at::ones_like(out));
    });
  }
}

// ---- _to_channels_last, autocast -----------------------------------------------------------

void to_channels_last_cases() {
  for (at::ScalarType dt : kDtypes) {
    for (const RoIShape& s : kRoIShapes) {
      const at::Tensor x0 = at::randn({s.b, s.c, s.h, s.w}, at::kDouble).to(dt);
      for (int layout = 0; layout < 4; ++layout) {
        run("_to_channels_last", [&] {
          const at::Tensor x = in_layout(x0, layout);
          const at::Tensor y = to_channels_last(x);
          if (!y.is_contiguous(at::MemoryFormat::ChannelsLast)) fail("_to_channels_last: not channels_last");
          same("_to_channels_last values", y, x);
        });
      }
    }
  }
  rejects("_to_channels_last rank 3", [&] { to_channels_last(at::zeros({2, 3, 4})); });
}

void autocast_cases() {
  // CPU autocast to bfloat16 and float16: the RoI ops run in float32 and cast back.
  for (at::ScalarType dt : {at::kBFloat16, at::kHalf}) {
    at::autocast::set_autocast_enabled(at::kCPU, true);
    at::autocast::set_autocast_dtype(at::kCPU, dt);
    run("autocast", [&] {
      const at::Tensor x = at::randn({2, 9, 10, 10}, at::kDouble).to(dt).requires_grad_(true);
      const at::Tensor rois = make_rois(12, 2, 10, 10, 1.0, at::kFloat);
      at::Tensor a = detops::ops::roi_align(x, rois, 1.0, 3, 3, 2, true);
      at::Tensor p = detops::ops::roi_pool_values(x, rois, 1.0, 3, 3);
      auto [q, argmax] = detops::ops::roi_pool(x, rois, 1.0, 3, 3);
      (a.sum() + p.sum() + q.sum()).backward();
    });
    at::autocast::set_autocast_enabled(at::kCPU, false);
    at::autocast::clear_cache();
  }
}

// ---- the C ABI -----------------------------------------------------------------------------

using detops_test::AotFn;

// A C ABI parameter list that also takes tensors (their data, sizes and dtype name).
struct AotCall : detops_test::AotCallList {
  using AotCallList::add;
  void add(const at::Tensor& t, const char* dtype) {
    add(t.data_ptr(), std::vector<int64_t>(t.sizes().begin(), t.sizes().end()), dtype);
  }
};

const char* aot_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "float32";
    case at::kDouble: return "float64";
    case at::kHalf: return "float16";
    case at::kBFloat16: return "bfloat16";
    case at::kInt: return "int32";
    default: return "int64";
  }
}

void expect_code(const std::string& what, int got, int want) {
  ++calls;
  if (got != want) {
    fail(what + ": returned " + std::to_string(got) + ", expected " + std::to_string(want) + " (" +
         DetopsAotLastError() + ")");
  }
}

// The calls of one entry that must succeed, then the same parameter list broken in every way
// the header names, each of which must give its status code.
void aot_entry(const std::string& name, AotFn fn, AotCall good) {
  expect_code(name, good(fn), DETOPS_AOT_OK);
  const int n = static_cast<int>(good.params.size());
  expect_code(name + " nparam 0", good(fn, 0), DETOPS_AOT_BAD_PARAM_COUNT);
  AotCall more = good;
  more.add(nullptr, {}, "float32");
  expect_code(name + " nparam + 1", more(fn), DETOPS_AOT_BAD_PARAM_COUNT);
  expect_code(name + " NULL params", fn(n, nullptr, good.ndims.data(), good.shapes.data(), good.dtypes.data(), nullptr, nullptr),
              DETOPS_AOT_BAD_POINTER);
  expect_code(name + " NULL shapes", fn(n, good.params.data(), good.ndims.data(), nullptr, good.dtypes.data(), nullptr, nullptr),
              DETOPS_AOT_BAD_POINTER);
  for (int i = 0; i < n; ++i) {
    const std::string p = name + " param " + std::to_string(i);
    AotCall c = good;
    c.dtypes[i] = nullptr;
    expect_code(p + " NULL dtype", c(fn), DETOPS_AOT_BAD_POINTER);
    c = good;
    c.dtypes[i] = "float8";
    expect_code(p + " unknown dtype", c(fn), DETOPS_AOT_BAD_DTYPE);
    c = good;
    c.dtypes[i] = "int32";  // int32 is only argmax's
    const bool int32 = std::strcmp(good.dtypes[i], "int32") == 0;
    expect_code(p + " int32", c(fn), int32 ? DETOPS_AOT_OK : DETOPS_AOT_BAD_DTYPE);
    c = good;
    c.ndims[i] = 9;
    c.shape_store[i].resize(9, 1);
    expect_code(p + " rank 9", c(fn), DETOPS_AOT_BAD_SHAPE);
    c = good;
    c.shape_store[i].push_back(1);
    c.ndims[i] += 1;
    expect_code(p + " rank + 1", c(fn), DETOPS_AOT_BAD_SHAPE);
    if (good.ndims[i] > 0) {
      c = good;
      c.shape_store[i][0] = -1;
      expect_code(p + " negative size", c(fn), DETOPS_AOT_BAD_SHAPE);
      c = good;
      c.shape_store[i][0] = int64_t{1} << 62;
      c.shape_store[i].back() = int64_t{1} << 62;
      expect_code(p + " size overflow", c(fn), DETOPS_AOT_BAD_SHAPE);
      c = good;
      c.params[i] = nullptr;
      int64_t numel = 1;
      for (int64_t v : c.shape_store[i]) numel *= v;
      if (numel > 0) expect_code(p + " NULL data", c(fn), DETOPS_AOT_BAD_POINTER);
      // a size one less (never more: the buffers hold what the good list says): disagrees with
      // the others or asks the op for another shape
      c = good;
      if (c.shape_store[i].back() > 0) {
        c.shape_store[i].back() -= 1;
        const int code = c(fn);
        ++calls;
        if (code != DETOPS_AOT_BAD_SHAPE && code != DETOPS_AOT_OP_ERROR && code != DETOPS_AOT_OK) {
          fail(p + " size - 1: returned " + std::to_string(code));
        }
      }
    }
  }
}

void aot_cases() {
  for (at::ScalarType dt : kDtypes) {
    const char* d = aot_name(dt);
    for (int64_t n : {0, 1, 9, 300}) {
      auto [boxes, scores] = make_boxes(n, dt, true);
      at::Tensor thr = at::full({1}, 0.5f);
      at::Tensor keep = at::full({n}, 7, at::kLong), count = at::full({1}, 7, at::kLong);
      AotCall c;
      c.add(boxes, d);
      c.add(scores, d);
      c.add(thr, "float32");
      c.add(keep, "int64");
      c.add(count, "int64");
      if (n == 9) {
        aot_entry("DetopsNms", &DetopsNms, c);
      } else {
        expect_code("DetopsNms", c(&DetopsNms), DETOPS_AOT_OK);
      }
      for (float t : {static_cast<float>(kNaN), static_cast<float>(kInf), -1.0f}) {
        thr.fill_(t);
        const int code = c(&DetopsNms);
        ++calls;
        if (code != DETOPS_AOT_OK && code != DETOPS_AOT_OP_ERROR) fail("DetopsNms threshold: code " + std::to_string(code));
      }
    }
    for (const RoIShape& s : {RoIShape{2, 9, 7, 6, 11, 3, 2}, RoIShape{1, 3, 5, 5, 0, 2, 2}, RoIShape{1, 0, 5, 5, 2, 2, 2}}) {
      const at::Tensor x = at::randn({s.b, s.c, s.h, s.w}, at::kDouble).to(dt);
      const at::Tensor rois = make_rois(s.k, s.b, s.h, s.w, 1.0, dt);
      at::Tensor attrs = at::tensor({1.0f, 2.0f, 1.0f});
      at::Tensor out = at::empty({s.k, s.c, s.ph, s.pw}, dt);
      AotCall fwd;
      fwd.add(x, d);
      fwd.add(rois, d);
      fwd.add(attrs, "float32");
      fwd.add(out, d);
      const bool full = s.k == 11;
      if (full) aot_entry("DetopsRoIAlignForward", &DetopsRoIAlignForward, fwd);
      expect_code("DetopsRoIAlignForward", fwd(&DetopsRoIAlignForward), DETOPS_AOT_OK);
      // attrs past what an int64 holds, NaN, inf: rejected or taken, never undefined
      for (float a1 : {static_cast<float>(kNaN), static_cast<float>(kInf), 1e30f, -1e30f, -5.0f, 2.5f}) {
        for (int which : {0, 1, 2}) {
          at::Tensor bad = at::tensor({1.0f, 2.0f, 1.0f});
          bad[which] = a1;
          AotCall c = fwd;
          c.params[2] = bad.data_ptr();
          const int code = c(&DetopsRoIAlignForward);
          ++calls;
          if (code != DETOPS_AOT_OK && code != DETOPS_AOT_OP_ERROR) {
            fail("DetopsRoIAlignForward attrs: code " + std::to_string(code));
          }
        }
      }
      at::Tensor gi = at::empty({s.b, s.c, s.h, s.w}, dt);
      at::Tensor g = at::randn({s.k, s.c, s.ph, s.pw}, at::kDouble).to(dt);
      AotCall bwd;
      bwd.add(g, d);
      bwd.add(rois, d);
      bwd.add(attrs, "float32");
      bwd.add(gi, d);
      if (full) aot_entry("DetopsRoIAlignBackward", &DetopsRoIAlignBackward, bwd);
      expect_code("DetopsRoIAlignBackward", bwd(&DetopsRoIAlignBackward), DETOPS_AOT_OK);
      at::Tensor pattrs = at::tensor({1.0f});
      at::Tensor argmax = at::empty({s.k, s.c, s.ph, s.pw}, at::kInt);
      AotCall pool;
      pool.add(x, d);
      pool.add(rois, d);
      pool.add(pattrs, "float32");
      pool.add(out, d);
      expect_code("DetopsRoIPoolForward values", pool(&DetopsRoIPoolForward), DETOPS_AOT_OK);
      pool.add(argmax, "int32");
      if (full) aot_entry("DetopsRoIPoolForward", &DetopsRoIPoolForward, pool);
      expect_code("DetopsRoIPoolForward", pool(&DetopsRoIPoolForward), DETOPS_AOT_OK);
      for (float sc : {static_cast<float>(kNaN), 0.0f, -1.0f, static_cast<float>(kInf)}) {
        pattrs.fill_(sc);
        expect_code("DetopsRoIPoolForward scale", pool(&DetopsRoIPoolForward), DETOPS_AOT_OP_ERROR);
      }
    }
  }
}

// ---- every registered op is driven ------------------------------------------------------------

// The ops this driver calls. A registered detops op missing here (a new op without its calls in
// this file) fails the run.
const char* const kDriven[] = {
    "nms", "batched_nms", "nms_padded", "roi_align", "_roi_align_backward", "roi_pool",
    "_roi_pool_values", "_roi_pool_backward", "_to_channels_last",
};

void check_every_op_driven() {
  for (const c10::OperatorName& op : c10::Dispatcher::singleton().getAllOpNames()) {
    const std::string prefix = "detops::";
    if (op.name.compare(0, prefix.size(), prefix) != 0) continue;
    const std::string name = op.name.substr(prefix.size());
    bool driven = false;
    for (const char* d : kDriven) driven = driven || name == d;
    if (!driven) fail("registered op " + op.name + " is never called by this driver: add its calls");
  }
}

// ---- the passes ------------------------------------------------------------------------------

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

template <typename F>
void section(const char* name, F&& f) {
  const auto t0 = std::chrono::steady_clock::now();
  const int64_t before = calls;
  f();
  std::printf("  %-28s %6lld calls  %6.1f s\n", name, static_cast<long long>(calls - before), seconds_since(t0));
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  const char* quick_env = std::getenv("DETOPS_SANITIZE_QUICK");
  bool quick = quick_env != nullptr && std::strcmp(quick_env, "1") == 0;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0) {
      quick = true;
    } else {
      std::fprintf(stderr, "usage: %s [--quick]\n", argv[0]);
      return 2;
    }
  }
  at::manual_seed(0);
  const auto t0 = std::chrono::steady_clock::now();
  check_every_op_driven();
  const size_t cache = size_t{64} << 20;
  // The first pass runs everything; the others repeat what depends on their setting.
  const std::vector<Setting> settings = {
      {2, 0, false}, {1, 0, false}, {2, cache, false}, {1, cache, true}};
  for (size_t i = 0; i < settings.size(); ++i) {
    const Setting& s = settings[i];
    if (quick && i == 3) break;
    std::printf("%s\n", s.name().c_str());
    Apply apply(s);
    const bool first = i == 0;
    section("nms, batched_nms", [] { nms_cases(); });
    section("nms_padded", [] { nms_padded_cases(); });
    section("roi_align", [&] { roi_align_cases(first); });
    section("roi_pool", [&] { roi_pool_cases(first); });
    if (first || s.threads == 1) section("roi_pool cpu_vector", [] { roi_pool_vector_cases(); });
    section("large outputs", [&] { large_cases(s.cache_bytes > 0); });
    if (first) {
      section("_to_channels_last", [] { to_channels_last_cases(); });
      section("autocast", [] { autocast_cases(); });
      section("C ABI", [] { aot_cases(); });
      section("rejected inputs", [] {
        nms_rejects();
        roi_align_rejects();
        roi_pool_rejects();
      });
    }
  }
  std::printf("detops sanitize driver: %lld calls, %d failures, %.1f s\n", static_cast<long long>(calls), failures,
              seconds_since(t0));
  return failures == 0 ? 0 : 1;
}
