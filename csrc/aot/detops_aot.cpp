// detops C ABI (see detops_aot.h for the parameter lists): raw buffers from a host framework are
// checked against the parameter list, wrapped as tensors without copying, passed to the
// detops::ops functions, and the results copied into the output buffers.
#include "aot/detops_aot.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <cstring>
#include <exception>
#include <limits>
#include <string>
#include <vector>

#ifdef WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#endif

#include "detops.h"

namespace {

thread_local std::string last_error;

// A failure with its status code; thrown inside an entry and turned into its return value.
struct AotError {
  int code;
  std::string message;
};

[[noreturn]] void fail(int code, const std::string& message) { throw AotError{code, message}; }

std::string param_name(const char* fn, int i, const char* name) {
  return std::string(fn) + ": parameter " + std::to_string(i) + " (" + name + ")";
}

struct DtypeName {
  const char* name;
  at::ScalarType type;
};

const DtypeName kDtypes[] = {
    {"float32", at::kFloat}, {"float16", at::kHalf},  {"float64", at::kDouble},
    {"bfloat16", at::kBFloat16}, {"int32", at::kInt}, {"int64", at::kLong},
};

bool is_float(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kDouble || t == at::kBFloat16;
}

// One parameter as described by the host: pointer, shape and dtype, validated.
struct Param {
  void* data = nullptr;
  std::vector<int64_t> shape;
  at::ScalarType dtype = at::kFloat;
  int64_t numel = 0;
};

// The parameter list of one call. The constructor validates everything that does not depend on
// the entry (pointers, ranks, sizes, dtype names) before anything reads a buffer.
class Params {
 public:
  Params(const char* fn, int expected_min, int expected_max, int nparam, void** params,
         int* ndims, int64_t** shapes, const char** dtypes)
      : fn_(fn) {
    if (nparam < expected_min || nparam > expected_max) {
      std::string want = std::to_string(expected_min);
      if (expected_max != expected_min) want += " or " + std::to_string(expected_max);
      fail(DETOPS_AOT_BAD_PARAM_COUNT,
           std::string(fn) + ": expected " + want + " parameters, got " + std::to_string(nparam));
    }
    if (params == nullptr || ndims == nullptr || shapes == nullptr || dtypes == nullptr) {
      fail(DETOPS_AOT_BAD_POINTER, std::string(fn) + ": params, ndims, shapes and dtypes must not be NULL");
    }
    params_.resize(nparam);
    for (int i = 0; i < nparam; ++i) {
      Param& p = params_[i];
      const std::string where = std::string(fn) + ": parameter " + std::to_string(i);
      if (dtypes[i] == nullptr) fail(DETOPS_AOT_BAD_POINTER, where + ": dtype name is NULL");
      bool known = false;
      for (const auto& d : kDtypes) {
        if (std::strcmp(dtypes[i], d.name) == 0) {
          p.dtype = d.type;
          known = true;
        }
      }
      if (!known) {
        fail(DETOPS_AOT_BAD_DTYPE,
             where + ": unknown dtype \"" + std::string(dtypes[i]) +
                 "\" (known: float32, float16, float64, bfloat16, int32, int64)");
      }
      const int nd = ndims[i];
      if (nd < 0 || nd > 8) fail(DETOPS_AOT_BAD_SHAPE, where + ": rank must be in [0, 8], got " + std::to_string(nd));
      if (nd > 0 && shapes[i] == nullptr) fail(DETOPS_AOT_BAD_POINTER, where + ": shape is NULL");
      const int64_t item = static_cast<int64_t>(c10::elementSize(p.dtype));
      int64_t numel = 1;
      for (int d = 0; d < nd; ++d) {
        const int64_t s = shapes[i][d];
        if (s < 0) fail(DETOPS_AOT_BAD_SHAPE, where + ": negative size " + std::to_string(s));
        if (s > 0 && numel > std::numeric_limits<int64_t>::max() / item / s) {
          fail(DETOPS_AOT_BAD_SHAPE, where + ": size overflows int64 bytes");
        }
        numel *= s;
        p.shape.push_back(s);
      }
      p.numel = numel;
      p.data = params[i];
      if (numel > 0 && p.data == nullptr) fail(DETOPS_AOT_BAD_POINTER, where + ": data is NULL");
    }
  }

  // Parameter i must have this rank and one of the float dtypes (or exactly `dtype`).
  const Param& get(int i, const char* name, int rank, at::ScalarType dtype = at::ScalarType::Undefined) const {
    const Param& p = params_.at(i);
    if (static_cast<int>(p.shape.size()) != rank) {
      fail(DETOPS_AOT_BAD_SHAPE, param_name(fn_, i, name) + " must have rank " + std::to_string(rank) +
                                     ", got " + std::to_string(p.shape.size()));
    }
    if (dtype == at::ScalarType::Undefined ? !is_float(p.dtype) : p.dtype != dtype) {
      fail(DETOPS_AOT_BAD_DTYPE,
           param_name(fn_, i, name) + " must be " +
               (dtype == at::ScalarType::Undefined ? std::string("float32, float16, float64 or bfloat16")
                                                   : std::string(c10::toString(dtype))) +
               ", got " + c10::toString(p.dtype));
    }
    return p;
  }

  void same_dtype(int i, const char* a, int j, const char* b) const {
    if (params_[i].dtype != params_[j].dtype) {
      fail(DETOPS_AOT_BAD_DTYPE, std::string(fn_) + ": " + a + " and " + b + " must have the same dtype, got " +
                                     c10::toString(params_[i].dtype) + " and " + c10::toString(params_[j].dtype));
    }
  }

  void size_is(int i, const char* name, int dim, int64_t want, const char* what) const {
    const int64_t got = params_[i].shape.at(dim);
    if (got != want) {
      fail(DETOPS_AOT_BAD_SHAPE, param_name(fn_, i, name) + ": size " + std::to_string(dim) + " must be " +
                                     what + " (" + std::to_string(want) + "), got " + std::to_string(got));
    }
  }

  // The device that holds every non-empty buffer of the call.
  at::Device device() const {
    bool found = false;
    at::Device dev(at::kCPU);
    for (size_t i = 0; i < params_.size(); ++i) {
      if (params_[i].numel == 0) continue;
      const at::Device d = device_of(params_[i].data);
      if (!found) {
        dev = d;
        found = true;
      } else if (d != dev) {
        fail(DETOPS_AOT_BAD_DEVICE, std::string(fn_) + ": all buffers must be on one device, parameter " +
                                        std::to_string(i) + " is on " + d.str() + ", an earlier one on " + dev.str());
      }
    }
    return dev;
  }

  size_t size() const { return params_.size(); }

 private:
  static at::Device device_of(const void* ptr) {
#ifdef WITH_CUDA
    cudaPointerAttributes attr;
    const cudaError_t err = cudaPointerGetAttributes(&attr, ptr);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();  // no driver or no device: host memory
      return at::Device(at::kCPU);
    }
    if (attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged) {
      return at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(attr.device));
    }
#else
    (void)ptr;
#endif
    return at::Device(at::kCPU);
  }

  const char* fn_;
  std::vector<Param> params_;
};

at::Tensor wrap(const Param& p, at::Device device) {
  const auto options = at::TensorOptions().dtype(p.dtype).device(device);
  // An empty buffer may come with any pointer (often null), which from_blob would reject for a
  // CUDA device: there is nothing to wrap, so hand out an empty tensor of the same shape.
  if (p.numel == 0) return at::empty(p.shape, options);
  return at::from_blob(p.data, p.shape, options);
}

// Host copies of the float32 scalars of an attrs parameter (which may live on the GPU).
std::vector<float> scalars(const Param& p, at::Device device) {
  at::Tensor t = wrap(p, device).to(at::kCPU).contiguous();
  const float* v = t.data_ptr<float>();
  return std::vector<float>(v, v + t.numel());
}

// attrs[1] and attrs[2] of the RoIAlign entries: sampling_ratio must be a whole number (a
// float beyond int64, or NaN, has no int64 value), aligned 0 or 1.
int64_t sampling_ratio_attr(const char* fn, float v) {
  if (!(std::fabs(v) <= 2147483648.0f) || std::nearbyint(v) != v) {
    fail(DETOPS_AOT_OP_ERROR, std::string(fn) + ": attrs[1] (sampling_ratio) must be an integer in [-2^31, 2^31], got " +
                                  std::to_string(v));
  }
  return static_cast<int64_t>(v);
}

bool aligned_attr(const char* fn, float v) {
  if (v != 0.0f && v != 1.0f) {
    fail(DETOPS_AOT_OP_ERROR, std::string(fn) + ": attrs[2] (aligned) must be 0 or 1, got " + std::to_string(v));
  }
  return v == 1.0f;
}

void copy_result(const char* fn, const at::Tensor& out, const at::Tensor& result) {
  if (!out.sizes().equals(result.sizes())) {
    fail(DETOPS_AOT_INTERNAL, std::string(fn) + ": the op returned a result of an unexpected shape");
  }
  if (out.numel() > 0) out.copy_(result);
}

// Runs body(device) with the CUDA device and stream of the call current, and turns every
// failure into a status code.
template <typename Parse, typename Body>
int guarded(const char* fn, Parse parse, Body body, void* stream) {
  try {
    Params params = parse();
    const at::Device device = params.device();
    if (device.is_cuda()) {
#ifdef WITH_CUDA
      c10::cuda::CUDAStreamGuard guard(
          c10::cuda::getStreamFromExternal(static_cast<cudaStream_t>(stream), device.index()));
      body(params, device);
#else
      fail(DETOPS_AOT_BAD_DEVICE, std::string(fn) + ": got CUDA buffers, but this libdetops_aot was built without CUDA kernels");
#endif
    } else {
      (void)stream;
      body(params, device);
    }
    last_error.clear();
    return DETOPS_AOT_OK;
  } catch (const AotError& e) {
    last_error = e.message;
    return e.code;
  } catch (const c10::Error& e) {
    last_error = std::string(fn) + ": " + e.what_without_backtrace();
    return DETOPS_AOT_OP_ERROR;
  } catch (const std::exception& e) {
    last_error = std::string(fn) + ": " + e.what();
    return DETOPS_AOT_INTERNAL;
  } catch (...) {
    last_error = std::string(fn) + ": unknown exception";
    return DETOPS_AOT_INTERNAL;
  }
}

// Shared by the RoI entries: input [B, C, H, W] and rois [K, 5] of one float dtype.
void check_rois(const Params& ps, int rois_index, int64_t k) {
  const Param& rois = ps.get(rois_index, "rois", 2);
  ps.size_is(rois_index, "rois", 0, k, "the number of RoIs");
  ps.size_is(rois_index, "rois", 1, 5, "5: batch index, x1, y1, x2, y2");
  (void)rois;
}

}  // namespace

extern "C" {

int DetopsNms(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes,
              void* stream, void* /*extra*/) {
  static const char* fn = "DetopsNms";
  return guarded(
      fn, [&] { return Params(fn, 5, 5, nparam, params, ndims, shapes, dtypes); },
      [&](const Params& ps, at::Device device) {
        const Param& boxes = ps.get(0, "boxes", 2);
        const int64_t n = boxes.shape[0];
        ps.size_is(0, "boxes", 1, 4, "4: x1, y1, x2, y2");
        const Param& scores = ps.get(1, "scores", 1);
        ps.size_is(1, "scores", 0, n, "the number of boxes");
        ps.same_dtype(0, "boxes", 1, "scores");
        const Param& thr = ps.get(2, "iou_threshold", 1, at::kFloat);
        ps.size_is(2, "iou_threshold", 0, 1, "1");
        const Param& keep = ps.get(3, "keep", 1, at::kLong);
        ps.size_is(3, "keep", 0, n, "the number of boxes");
        const Param& count = ps.get(4, "count", 1, at::kLong);
        ps.size_is(4, "count", 0, 1, "1");

        at::Tensor keep_out = wrap(keep, device);
        at::Tensor count_out = wrap(count, device);
        // N = 0 too goes through the op, which checks the threshold
        const double threshold = scalars(thr, device)[0];
        at::Tensor kept = detops::ops::nms(wrap(boxes, device), wrap(scores, device), threshold);
        const int64_t k = kept.size(0);
        keep_out.fill_(-1);
        if (k > 0) keep_out.narrow(0, 0, k).copy_(kept);
        count_out.fill_(k);
      },
      stream);
}

int DetopsRoIAlignForward(int nparam, void** params, int* ndims, int64_t** shapes,
                          const char** dtypes, void* stream, void* /*extra*/) {
  static const char* fn = "DetopsRoIAlignForward";
  return guarded(
      fn, [&] { return Params(fn, 4, 4, nparam, params, ndims, shapes, dtypes); },
      [&](const Params& ps, at::Device device) {
        const Param& input = ps.get(0, "input", 4);
        const Param& output = ps.get(3, "output", 4);
        const int64_t k = output.shape[0];
        check_rois(ps, 1, k);
        ps.same_dtype(0, "input", 1, "rois");
        ps.same_dtype(0, "input", 3, "output");
        const Param& attrs = ps.get(2, "attrs", 1, at::kFloat);
        ps.size_is(2, "attrs", 0, 3, "3: spatial_scale, sampling_ratio, aligned");
        ps.size_is(3, "output", 1, input.shape[1], "the channels of input");

        const std::vector<float> a = scalars(attrs, device);
        const int64_t sampling_ratio = sampling_ratio_attr(fn, a[1]);
        const bool aligned = aligned_attr(fn, a[2]);
        at::Tensor result = detops::ops::roi_align(
            wrap(input, device), wrap(ps.get(1, "rois", 2), device), a[0], output.shape[2],
            output.shape[3], sampling_ratio, aligned);
        copy_result(fn, wrap(output, device), result);
      },
      stream);
}

int DetopsRoIAlignBackward(int nparam, void** params, int* ndims, int64_t** shapes,
                           const char** dtypes, void* stream, void* /*extra*/) {
  static const char* fn = "DetopsRoIAlignBackward";
  return guarded(
      fn, [&] { return Params(fn, 4, 4, nparam, params, ndims, shapes, dtypes); },
      [&](const Params& ps, at::Device device) {
        const Param& grad = ps.get(0, "grad", 4);
        const Param& grad_input = ps.get(3, "grad_input", 4);
        check_rois(ps, 1, grad.shape[0]);
        ps.same_dtype(0, "grad", 1, "rois");
        ps.same_dtype(0, "grad", 3, "grad_input");
        const Param& attrs = ps.get(2, "attrs", 1, at::kFloat);
        ps.size_is(2, "attrs", 0, 3, "3: spatial_scale, sampling_ratio, aligned");
        ps.size_is(3, "grad_input", 1, grad.shape[1], "the channels of grad");

        const std::vector<float> a = scalars(attrs, device);
        const int64_t sampling_ratio = sampling_ratio_attr(fn, a[1]);
        const bool aligned = aligned_attr(fn, a[2]);
        const auto& s = grad_input.shape;
        at::Tensor result = detops::ops::roi_align_backward(
            wrap(grad, device), wrap(ps.get(1, "rois", 2), device), a[0], grad.shape[2],
            grad.shape[3], s[0], s[1], s[2], s[3], sampling_ratio, aligned);
        copy_result(fn, wrap(grad_input, device), result);
      },
      stream);
}

int DetopsRoIPoolForward(int nparam, void** params, int* ndims, int64_t** shapes,
                         const char** dtypes, void* stream, void* /*extra*/) {
  static const char* fn = "DetopsRoIPoolForward";
  return guarded(
      fn, [&] { return Params(fn, 4, 5, nparam, params, ndims, shapes, dtypes); },
      [&](const Params& ps, at::Device device) {
        const Param& input = ps.get(0, "input", 4);
        const Param& output = ps.get(3, "output", 4);
        check_rois(ps, 1, output.shape[0]);
        ps.same_dtype(0, "input", 1, "rois");
        ps.same_dtype(0, "input", 3, "output");
        const Param& attrs = ps.get(2, "attrs", 1, at::kFloat);
        ps.size_is(2, "attrs", 0, 1, "1: spatial_scale");
        ps.size_is(3, "output", 1, input.shape[1], "the channels of input");
        if (ps.size() == 5) {
          ps.get(4, "argmax", 4, at::kInt);
          for (int d = 0; d < 4; ++d) ps.size_is(4, "argmax", d, output.shape[d], "the size of output");
        }

        const std::vector<float> a = scalars(attrs, device);
        const at::Tensor in = wrap(input, device), rois = wrap(ps.get(1, "rois", 2), device);
        if (ps.size() == 5) {
          auto result = detops::ops::roi_pool(in, rois, a[0], output.shape[2], output.shape[3]);
          copy_result(fn, wrap(output, device), std::get<0>(result));
          copy_result(fn, wrap(ps.get(4, "argmax", 4, at::kInt), device), std::get<1>(result));
        } else {  // no argmax asked for: none computed
          copy_result(
              fn, wrap(output, device), detops::ops::roi_pool_values(in, rois, a[0], output.shape[2], output.shape[3]));
        }
      },
      stream);
}

const char* DetopsAotLastError(void) { return last_error.c_str(); }

}  // extern "C"
