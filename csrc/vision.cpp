// The one detops module: op schemas and their autocast kernels, the public C++ API, and (in the
// Python extension) the maskrcnn-benchmark style pybind11 entries. Kernels live in cpu/<op>.cpp
// and cuda/<op>.cu and register themselves with TORCH_LIBRARY_IMPL; the entries here only call
// the dispatcher.
#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include <atomic>
#include <cstring>
#include <limits>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "common/checks.h"
#include "common/kernel_choice.h"
#include "cpu/output_cache.h"
#include "detops.h"

#ifdef DETOPS_WITH_PYTHON
#include <torch/extension.h>
#endif

#include <torch/version.h>

// "major.minor.patch" of the torch headers this file was compiled against.
#define DETOPS_STR2(x) #x
#define DETOPS_STR(x) DETOPS_STR2(x)
#define DETOPS_TORCH_VERSION \
  DETOPS_STR(TORCH_VERSION_MAJOR) "." DETOPS_STR(TORCH_VERSION_MINOR) "." DETOPS_STR(TORCH_VERSION_PATCH)

namespace {

// What an op does under torch.autocast (its AutocastCPU and AutocastCUDA kernels).
enum class Autocast {
  // Nothing: autocast falls through to the op. For ops whose kernels take any mix of float
  // dtypes, and for backward ops (autograd replays the forward's casts).
  kNone,
  // Run in float32: the floating tensor arguments are cast to float32
  // (at::autocast::cached_cast: only those on the autocast's device, float64 stays), and the
  // floating outputs back to the dtype of the first tensor argument as it came (the input's);
  // integer outputs stay as they are. For kernels that need one float dtype for all their
  // arguments, or whose sums lose too much in float16 / bfloat16.
  kFloat32,
};

struct OpDef {
  const char* schema;
  Autocast autocast;
};

// Every detops op: its schema and its autocast policy. TORCH_LIBRARY defines the ops from this
// table, a build without CUDA kernels registers its CUDA error for each of them from it, and the
// autocast kernels are registered from it, so no other list of the ops is kept by hand. Kernels
// register themselves under these names (cpu/<op>.cpp, cuda/<op>.cu).
constexpr OpDef kSchemas[] = {
    {"nms(Tensor boxes, Tensor scores, float iou_threshold) -> Tensor", Autocast::kNone},
    {"batched_nms(Tensor boxes, Tensor scores, Tensor idxs, float iou_threshold) -> Tensor",
     Autocast::kNone},
    {"nms_padded(Tensor boxes, Tensor scores, float iou_threshold, float score_threshold, "
     "int max_output) -> (Tensor, Tensor)",
     Autocast::kNone},
    // bilinear sums of many samples lose too much in float16 / bfloat16 (torchvision does the same)
    {"roi_align(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, "
     "SymInt pooled_width, int sampling_ratio, bool aligned) -> Tensor",
     Autocast::kFloat32},
    {"_roi_align_backward(Tensor grad, Tensor rois, float spatial_scale, SymInt pooled_height, "
     "SymInt pooled_width, SymInt batch_size, SymInt channels, SymInt height, SymInt width, "
     "int sampling_ratio, bool aligned) -> Tensor",
     Autocast::kNone},
    // max pooling is exact: float32 only fixes the dtype mix autocast makes (bfloat16 features
    // with float32 RoIs), which the kernels reject; argmax stays int32
    {"roi_pool(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, "
     "SymInt pooled_width) -> (Tensor, Tensor)",
     Autocast::kFloat32},
    {"_roi_pool_values(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, "
     "SymInt pooled_width) -> Tensor",
     Autocast::kFloat32},
    {"_roi_pool_backward(Tensor grad, Tensor rois, Tensor argmax, float spatial_scale, "
     "SymInt pooled_height, SymInt pooled_width, SymInt batch_size, SymInt channels, "
     "SymInt height, SymInt width) -> Tensor",
     Autocast::kNone},
    // input's values in a new channels_last tensor: the RoI ops' autograd returns the gradient of
    // a channels_last CPU input through it (their backwards write NCHW planes)
    {"_to_channels_last(Tensor input) -> Tensor", Autocast::kNone},
};

// The op's name: its schema up to '('.
std::string op_name(const char* schema) {
  return std::string(schema, std::strchr(schema, '('));
}

// The kFloat32 autocast kernel of every op that has one (a boxed kernel: it reads the op's
// arguments and outputs from the stack). It runs the op below its autocast key on the casts,
// as a kernel for that op alone would.
template <c10::DispatchKey kAutocastKey, c10::DeviceType kDeviceType>
void autocast_float32(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(kAutocastKey);
  const size_t num_args = op.schema().arguments().size();
  const size_t first = stack->size() - num_args;
  std::optional<at::ScalarType> out_dtype;  // the first tensor argument's dtype
  for (size_t i = first; i < stack->size(); ++i) {
    c10::IValue& arg = (*stack)[i];
    if (!arg.isTensor()) continue;
    if (!out_dtype) out_dtype = arg.toTensor().scalar_type();
    at::Tensor cast = at::autocast::cached_cast(at::kFloat, arg.toTensor(), kDeviceType);
    arg = std::move(cast);
  }
  op.callBoxed(stack);
  if (!out_dtype) return;
  const size_t num_outputs = op.schema().returns().size();
  for (size_t i = stack->size() - num_outputs; i < stack->size(); ++i) {
    c10::IValue& out = (*stack)[i];
    if (!out.isTensor() || !out.toTensor().is_floating_point()) continue;
    at::Tensor back = out.toTensor().to(*out_dtype);
    out = std::move(back);
  }
}

template <c10::DispatchKey kAutocastKey, c10::DeviceType kDeviceType>
void register_autocast(torch::Library& m) {
  for (const OpDef& def : kSchemas) {
    if (def.autocast != Autocast::kFloat32) continue;
    m.impl(
        op_name(def.schema).c_str(),
        torch::CppFunction::makeFromBoxedFunction<&autocast_float32<kAutocastKey, kDeviceType>>());
  }
}

}  // namespace

TORCH_LIBRARY(detops, m) {
  for (const OpDef& def : kSchemas) m.def(def.schema);
}

TORCH_LIBRARY_IMPL(detops, AutocastCUDA, m) {
  register_autocast<c10::DispatchKey::AutocastCUDA, c10::DeviceType::CUDA>(m);
}

TORCH_LIBRARY_IMPL(detops, AutocastCPU, m) {
  register_autocast<c10::DispatchKey::AutocastCPU, c10::DeviceType::CPU>(m);
}

#ifndef WITH_CUDA
namespace {
// A build without CUDA kernels still owns the CUDA dispatch key of every op, so that a CUDA
// tensor gets an explanation and a rebuild command instead of "could not run ... with
// arguments from the 'CUDA' backend".
void cuda_not_built(const c10::OperatorHandle& op, torch::jit::Stack* /*stack*/) {
  std::string name = op.schema().name();
  const auto sep = name.find("::");
  if (sep != std::string::npos) name = "detops." + name.substr(sep + 2);
  DETOPS_CHECK(
      false, name, ": got CUDA tensors, but this detops._C was built without CUDA kernels "
      "(against torch ", DETOPS_TORCH_VERSION, ", CPU only). Rebuild it with nvcc on the PATH "
      "and a CUDA build of torch: FORCE_CUDA=1 pip install -e . --no-build-isolation");
}
}  // namespace

TORCH_LIBRARY_IMPL(detops, CUDA, m) {
  for (const OpDef& def : kSchemas) {
    m.impl(op_name(def.schema).c_str(), torch::CppFunction::makeFromBoxedFunction<&cuda_not_built>());
  }
}
#endif

namespace detops {
namespace ops {

namespace {
template <typename Sig>
c10::TypedOperatorHandle<Sig> op_handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}
}  // namespace

at::Tensor nms(const at::Tensor& boxes, const at::Tensor& scores, double iou_threshold) {
  static auto op = op_handle<at::Tensor(const at::Tensor&, const at::Tensor&, double)>("detops::nms");
  return op.call(boxes, scores, iou_threshold);
}

at::Tensor batched_nms(
    const at::Tensor& boxes, const at::Tensor& scores, const at::Tensor& idxs,
    double iou_threshold) {
  static auto op = op_handle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, double)>(
      "detops::batched_nms");
  return op.call(boxes, scores, idxs, iou_threshold);
}

std::tuple<at::Tensor, at::Tensor> nms_padded(
    const at::Tensor& boxes, const at::Tensor& scores, double iou_threshold,
    double score_threshold, int64_t max_output) {
  static auto op = op_handle<std::tuple<at::Tensor, at::Tensor>(
      const at::Tensor&, const at::Tensor&, double, double, int64_t)>("detops::nms_padded");
  return op.call(boxes, scores, iou_threshold, score_threshold, max_output);
}

at::Tensor roi_align(
    const at::Tensor& input, const at::Tensor& rois, double spatial_scale, int64_t pooled_height,
    int64_t pooled_width, int64_t sampling_ratio, bool aligned) {
  static auto op = op_handle<at::Tensor(
      const at::Tensor&, const at::Tensor&, double, c10::SymInt, c10::SymInt, int64_t, bool)>(
      "detops::roi_align");
  return op.call(
      input, rois, spatial_scale, c10::SymInt(pooled_height), c10::SymInt(pooled_width),
      sampling_ratio, aligned);
}

at::Tensor roi_align_backward(
    const at::Tensor& grad, const at::Tensor& rois, double spatial_scale, int64_t pooled_height,
    int64_t pooled_width, int64_t batch_size, int64_t channels, int64_t height, int64_t width,
    int64_t sampling_ratio, bool aligned) {
  static auto op = op_handle<at::Tensor(
      const at::Tensor&, const at::Tensor&, double, c10::SymInt, c10::SymInt, c10::SymInt,
      c10::SymInt, c10::SymInt, c10::SymInt, int64_t, bool)>("detops::_roi_align_backward");
  return op.call(
      grad, rois, spatial_scale, c10::SymInt(pooled_height), c10::SymInt(pooled_width),
      c10::SymInt(batch_size), c10::SymInt(channels), c10::SymInt(height), c10::SymInt(width),
      sampling_ratio, aligned);
}

std::tuple<at::Tensor, at::Tensor> roi_pool(
    const at::Tensor& input, const at::Tensor& rois, double spatial_scale, int64_t pooled_height,
    int64_t pooled_width) {
  static auto op = op_handle<std::tuple<at::Tensor, at::Tensor>(
      const at::Tensor&, const at::Tensor&, double, c10::SymInt, c10::SymInt)>("detops::roi_pool");
  return op.call(
      input, rois, spatial_scale, c10::SymInt(pooled_height), c10::SymInt(pooled_width));
}

at::Tensor roi_pool_values(
    const at::Tensor& input, const at::Tensor& rois, double spatial_scale, int64_t pooled_height,
    int64_t pooled_width) {
  static auto op = op_handle<at::Tensor(
      const at::Tensor&, const at::Tensor&, double, c10::SymInt, c10::SymInt)>("detops::_roi_pool_values");
  return op.call(input, rois, spatial_scale, c10::SymInt(pooled_height), c10::SymInt(pooled_width));
}

at::Tensor roi_pool_backward(
    const at::Tensor& grad, const at::Tensor& rois, const at::Tensor& argmax,
    double spatial_scale, int64_t pooled_height, int64_t pooled_width, int64_t batch_size,
    int64_t channels, int64_t height, int64_t width) {
  static auto op = op_handle<at::Tensor(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, double, c10::SymInt, c10::SymInt,
      c10::SymInt, c10::SymInt, c10::SymInt, c10::SymInt)>("detops::_roi_pool_backward");
  return op.call(
      grad, rois, argmax, spatial_scale, c10::SymInt(pooled_height), c10::SymInt(pooled_width),
      c10::SymInt(batch_size), c10::SymInt(channels), c10::SymInt(height), c10::SymInt(width));
}

bool with_cuda() {
#ifdef WITH_CUDA
  return true;
#else
  return false;
#endif
}

// The settings of common/kernel_choice.h (internal, for tests and benchmarks).
namespace {
std::atomic<int> roi_kernel_choice{static_cast<int>(RoIKernel::kAuto)};
std::atomic<int> cpu_vector_choice{static_cast<int>(CpuVector::kAuto)};
}  // namespace

RoIKernel roi_kernel() {
  return static_cast<RoIKernel>(roi_kernel_choice.load(std::memory_order_relaxed));
}

RoIKernel set_roi_kernel(RoIKernel choice) {
  return static_cast<RoIKernel>(roi_kernel_choice.exchange(static_cast<int>(choice)));
}

CpuVector cpu_vector() {
  return static_cast<CpuVector>(cpu_vector_choice.load(std::memory_order_relaxed));
}

CpuVector set_cpu_vector(CpuVector choice) {
  return static_cast<CpuVector>(cpu_vector_choice.exchange(static_cast<int>(choice)));
}

namespace {
std::mutex pass_limits_mutex;
DeterministicPassLimits pass_limits;
}  // namespace

DeterministicPassLimits deterministic_pass_limits() {
  std::lock_guard<std::mutex> lock(pass_limits_mutex);
  return pass_limits;
}

DeterministicPassLimits set_deterministic_pass_limits(DeterministicPassLimits limits) {
  std::lock_guard<std::mutex> lock(pass_limits_mutex);
  const DeterministicPassLimits previous = pass_limits;
  pass_limits = limits;
  return previous;
}

}  // namespace ops
}  // namespace detops

#ifdef DETOPS_WITH_PYTHON
namespace py = pybind11;

namespace {

// A module function `fn(arg: str) -> str` that sets a process-wide choice by name (names[i] is
// enum value i) and returns the name of the previous choice.
template <typename Choice>
void def_choice(
    py::module& m, const char* fn, const char* arg, std::vector<std::string> names,
    Choice (*set)(Choice), const char* doc) {
  m.def(
      fn,
      [fn, arg, names, set](const std::string& name) {
        int choice = -1;
        std::string listed;
        for (size_t i = 0; i < names.size(); ++i) {
          if (name == names[i]) choice = static_cast<int>(i);
          listed += (i == 0 ? "'" : i + 1 == names.size() ? " or '" : ", '") + names[i] + "'";
        }
        DETOPS_CHECK(choice >= 0, "detops.", fn, ": ", arg, " must be ", listed, ", got '", name, "'");
        const Choice previous = set(static_cast<Choice>(choice));
        return names[static_cast<size_t>(previous)];
      },
      doc, py::arg(arg));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "detops compiled ops (maskrcnn-benchmark style entries over the dispatcher ops)";
  m.def("nms", &detops::ops::nms, "NMS: kept indices by decreasing score", py::arg("dets"),
        py::arg("scores"), py::arg("threshold"));
  m.def("batched_nms", &detops::ops::batched_nms, "per-category NMS", py::arg("boxes"),
        py::arg("scores"), py::arg("idxs"), py::arg("threshold"));
  m.def("nms_padded", &detops::ops::nms_padded,
        "fixed-shape batched NMS: (indices [B, max_output] padded with -1, counts [B])",
        py::arg("boxes"), py::arg("scores"), py::arg("iou_threshold"),
        py::arg("score_threshold") = -std::numeric_limits<double>::infinity(),
        py::arg("max_output") = 100);
  m.def("roi_align_forward", &detops::ops::roi_align, "RoIAlign forward", py::arg("input"),
        py::arg("rois"), py::arg("spatial_scale"), py::arg("pooled_height"),
        py::arg("pooled_width"), py::arg("sampling_ratio"), py::arg("aligned") = false);
  m.def("roi_align_backward", &detops::ops::roi_align_backward, "RoIAlign backward",
        py::arg("grad"), py::arg("rois"), py::arg("spatial_scale"), py::arg("pooled_height"),
        py::arg("pooled_width"), py::arg("batch_size"), py::arg("channels"), py::arg("height"),
        py::arg("width"), py::arg("sampling_ratio"), py::arg("aligned") = false);
  m.def("roi_pool_forward", &detops::ops::roi_pool, "RoIPool forward: (output, argmax)",
        py::arg("input"), py::arg("rois"), py::arg("spatial_scale"), py::arg("pooled_height"),
        py::arg("pooled_width"));
  m.def(
      "roi_pool_backward",
      [](const at::Tensor& grad, const at::Tensor& /*input*/, const at::Tensor& rois,
         const at::Tensor& argmax, double spatial_scale, int64_t pooled_height,
         int64_t pooled_width, int64_t batch_size, int64_t channels, int64_t height,
         int64_t width) {
        return detops::ops::roi_pool_backward(
            grad, rois, argmax, spatial_scale, pooled_height, pooled_width, batch_size, channels,
            height, width);
      },
      "RoIPool backward (input is accepted for maskrcnn-benchmark compatibility and unused)",
      py::arg("grad"), py::arg("input"), py::arg("rois"), py::arg("argmax"),
      py::arg("spatial_scale"), py::arg("pooled_height"), py::arg("pooled_width"),
      py::arg("batch_size"), py::arg("channels"), py::arg("height"), py::arg("width"));
  m.def("with_cuda", &detops::ops::with_cuda, "whether CUDA kernels were compiled in");
  def_choice<detops::ops::RoIKernel>(
      m, "_set_roi_kernel", "kernel", {"auto", "band", "gather", "tiled", "generic"},
      &detops::ops::set_roi_kernel,
      "choose the CUDA roi_align / roi_pool kernels ('auto', 'band', 'gather'; 'tiled' and 'generic' "
      "force roi_align's gathers where they take the shapes); returns the previous choice");
  def_choice<detops::ops::CpuVector>(
      m, "_set_cpu_vector", "choice", {"auto", "sse2", "scalar", "avx2", "avx512"},
      &detops::ops::set_cpu_vector,
      "choose the instructions of the CPU roi_pool forward ('auto', 'sse2', 'scalar', 'avx2', "
      "'avx512'); returns the previous choice");
  m.def(
      "_set_deterministic_pass_limits",
      [](int64_t max_entries, int64_t max_channels, bool wide_keys) {
        DETOPS_CHECK(
            max_entries >= 0 && max_channels >= 0, "detops._C._set_deterministic_pass_limits: max_entries and "
            "max_channels must be >= 0, got ", max_entries, " and ", max_channels);
        const detops::ops::DeterministicPassLimits previous =
            detops::ops::set_deterministic_pass_limits({max_entries, max_channels, wide_keys});
        return std::make_tuple(previous.max_entries, previous.max_channels, previous.wide_keys);
      },
      "lower the limits of one pass of the deterministic CUDA roi_align backward, so that small inputs "
      "take its passes over chunks of RoIs (max_entries contributions a pass) and slices of channels "
      "(max_channels a pass), and int64 keys (wide_keys); 0 / False: the kernels' own limits. Returns "
      "the previous limits",
      py::arg("max_entries") = 0, py::arg("max_channels") = 0, py::arg("wide_keys") = false);
  m.def(
      "_set_cpu_output_cache",
      [](int64_t bytes) {
        DETOPS_CHECK(bytes >= 0, "detops._C._set_cpu_output_cache: bytes must be >= 0, got ", bytes);
        return static_cast<int64_t>(detops::cpu::OutputCache::get().set_limit(static_cast<size_t>(bytes)));
      },
      "keep at most this many bytes of the CPU kernels' freed output buffers for reuse (0: none, "
      "and give back those kept); returns the previous limit",
      py::arg("bytes"));
  m.def(
      "_cpu_output_cache_bytes", []() { return static_cast<int64_t>(detops::cpu::OutputCache::get().kept_bytes()); },
      "bytes of freed CPU output buffers kept for reuse now");
  m.def(
      "_set_nms_kernel",
      [](const std::string& rank, const std::string& pass) {
        static const std::vector<std::string> ranks{"auto", "count", "radix", "sort"};
        static const std::vector<std::string> passes{"auto", "block", "dataflow"};
        const auto find = [](const std::vector<std::string>& names, const std::string& name,
                             const char* arg) {
          std::string listed;
          for (size_t i = 0; i < names.size(); ++i) {
            if (name == names[i]) return static_cast<int>(i);
            listed += (i == 0 ? "'" : i + 1 == names.size() ? " or '" : ", '") + names[i] + "'";
          }
          DETOPS_CHECK(false, "detops._C._set_nms_kernel: ", arg, " must be ", listed, ", got '", name, "'");
          return -1;
        };
        const int r = find(ranks, rank, "rank"), p = find(passes, pass, "pass_");
        const detops::ops::NmsKernel previous = detops::ops::set_nms_kernel(
            {static_cast<detops::ops::NmsRankChoice>(r), static_cast<detops::ops::NmsPassChoice>(p)});
        return std::make_tuple(
            ranks[static_cast<size_t>(previous.rank)], passes[static_cast<size_t>(previous.pass)]);
      },
      "choose the CUDA NMS kernels: rank ('auto', 'count', 'radix', 'sort'; nms_padded: 'count' "
      "or 'sort') and nms / batched_nms's greedy pass ('auto', 'block', 'dataflow'); a choice the "
      "input cannot take falls back to the automatic one. Returns the previous (rank, pass)",
      py::arg("rank") = "auto", py::arg("pass_") = "auto");
  m.def("torch_version", []() { return std::string(DETOPS_TORCH_VERSION); },
        "the torch version this extension was built against");
}
#endif
