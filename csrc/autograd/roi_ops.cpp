// Autograd of roi_align and roi_pool, registered on the ops themselves (the Autograd dispatch
// key), in C++: a call that needs no gradient goes through without any Python, and C++ callers
// of the dispatcher ops get gradients too. _roi_pool_values (roi_pool's output alone) runs the
// kernels without argmax when no gradient is needed, and roi_pool's Function otherwise. Each
// backward op has a node whose own backward raises: there is no double backward.
//
// Under autocast the ops may run in float32 on casts of the arguments (vision.cpp): the
// gradient is taken in the RoIs' dtype and returned in the input's dtype, as the op saw them.
//
// The backwards write the gradient plane by plane (NCHW). For an input stored channels_last the
// gradient is returned in that layout (_to_channels_last), as torch's own pooling ops do. A
// leaf's AccumulateGrad, or the next op's backward, would otherwise make that copy itself: on the
// CPU into fresh 4 KiB pages, on CUDA through torch's copy, which reads a sector for each value.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/library.h>

#include <vector>

#include "../common/checks.h"

namespace detops {
namespace ops {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::Variable;
using torch::autograd::variable_list;

template <typename Sig>
c10::TypedOperatorHandle<Sig> op_handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

using RoIAlignSig = at::Tensor(const at::Tensor&, const at::Tensor&, double, c10::SymInt, c10::SymInt, int64_t, bool);
using RoIAlignBackwardSig = at::Tensor(
    const at::Tensor&, const at::Tensor&, double, c10::SymInt, c10::SymInt, c10::SymInt, c10::SymInt, c10::SymInt,
    c10::SymInt, int64_t, bool);
using RoIPoolSig =
    std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, double, c10::SymInt, c10::SymInt);
using RoIPoolValuesSig = at::Tensor(const at::Tensor&, const at::Tensor&, double, c10::SymInt, c10::SymInt);
using RoIPoolBackwardSig = at::Tensor(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, double, c10::SymInt, c10::SymInt, c10::SymInt,
    c10::SymInt, c10::SymInt, c10::SymInt);

// The dispatcher ops the autograd kernels call below the Autograd key.
const c10::TypedOperatorHandle<RoIAlignSig>& roi_align_op() {
  static const auto op = op_handle<RoIAlignSig>("detops::roi_align");
  return op;
}
const c10::TypedOperatorHandle<RoIAlignBackwardSig>& roi_align_backward_op() {
  static const auto op = op_handle<RoIAlignBackwardSig>("detops::_roi_align_backward");
  return op;
}
const c10::TypedOperatorHandle<RoIPoolSig>& roi_pool_op() {
  static const auto op = op_handle<RoIPoolSig>("detops::roi_pool");
  return op;
}
const c10::TypedOperatorHandle<RoIPoolValuesSig>& roi_pool_values_op() {
  static const auto op = op_handle<RoIPoolValuesSig>("detops::_roi_pool_values");
  return op;
}
const c10::TypedOperatorHandle<RoIPoolBackwardSig>& roi_pool_backward_op() {
  static const auto op = op_handle<RoIPoolBackwardSig>("detops::_roi_pool_backward");
  return op;
}
const c10::TypedOperatorHandle<at::Tensor(const at::Tensor&)>& to_channels_last_op() {
  static const auto op = op_handle<at::Tensor(const at::Tensor&)>("detops::_to_channels_last");
  return op;
}

// Whether the gradient of `input` goes back channels_last: a CPU or CUDA input stored that way
// (and not NCHW-contiguous as well, as a map with one channel or one pixel is).
bool channels_last_grad(const at::Tensor& input) {
  return (input.is_cpu() || input.is_cuda()) && input.dim() == 4 && !input.is_contiguous() &&
      input.is_contiguous(at::MemoryFormat::ChannelsLast);
}

// The gradient of the input, in its dtype, channels_last where channels_last_grad said so.
at::Tensor input_grad(AutogradContext* ctx, const at::Tensor& grad) {
  at::Tensor g = grad.to(ctx->saved_data["input_dtype"].toScalarType());
  return ctx->saved_data["channels_last"].toBool() ? to_channels_last_op().call(g) : g;
}

// The saved input shape [B, C, H, W] as SymInts.
std::vector<c10::SymInt> saved_shape(AutogradContext* ctx) {
  std::vector<c10::SymInt> shape;
  for (const auto& v : ctx->saved_data["input_shape"].toList()) shape.push_back(v.get().toSymInt());
  return shape;
}

[[noreturn]] void no_double_backward(const char* op, const char* backward_op) {
  DETOPS_CHECK(false, op, ": double backward (the gradient of ", backward_op, ") is not supported");
}

class RoIAlignFunction : public torch::autograd::Function<RoIAlignFunction> {
 public:
  static variable_list forward(
      AutogradContext* ctx, const Variable& input, const Variable& rois, double spatial_scale,
      c10::SymInt pooled_height, c10::SymInt pooled_width, int64_t sampling_ratio, bool aligned) {
    ctx->saved_data["spatial_scale"] = spatial_scale;
    ctx->saved_data["pooled_height"] = pooled_height;
    ctx->saved_data["pooled_width"] = pooled_width;
    ctx->saved_data["sampling_ratio"] = sampling_ratio;
    ctx->saved_data["aligned"] = aligned;
    ctx->saved_data["input_shape"] = input.sym_sizes();
    ctx->saved_data["input_dtype"] = input.scalar_type();
    ctx->saved_data["channels_last"] = channels_last_grad(input);
    ctx->save_for_backward({rois});
    at::AutoDispatchBelowADInplaceOrView guard;
    return {roi_align_op().call(
        input, rois, spatial_scale, std::move(pooled_height), std::move(pooled_width), sampling_ratio, aligned)};
  }

  static variable_list backward(AutogradContext* ctx, const variable_list& grad_output) {
    variable_list grads(7);
    if (!ctx->needs_input_grad(0) || !grad_output[0].defined()) return grads;
    const Variable rois = ctx->get_saved_variables()[0];
    const auto shape = saved_shape(ctx);
    grads[0] = input_grad(
        ctx, roi_align_backward_op().call(
                 grad_output[0].to(rois.scalar_type()), rois, ctx->saved_data["spatial_scale"].toDouble(),
                 ctx->saved_data["pooled_height"].toSymInt(), ctx->saved_data["pooled_width"].toSymInt(),
                 shape[0], shape[1], shape[2], shape[3], ctx->saved_data["sampling_ratio"].toInt(),
                 ctx->saved_data["aligned"].toBool()));
    return grads;
  }
};

class RoIAlignBackwardFunction : public torch::autograd::Function<RoIAlignBackwardFunction> {
 public:
  static variable_list forward(
      AutogradContext* /*ctx*/, const Variable& grad, const Variable& rois, double spatial_scale,
      c10::SymInt pooled_height, c10::SymInt pooled_width, c10::SymInt batch_size, c10::SymInt channels,
      c10::SymInt height, c10::SymInt width, int64_t sampling_ratio, bool aligned) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return {roi_align_backward_op().call(
        grad, rois, spatial_scale, std::move(pooled_height), std::move(pooled_width), std::move(batch_size),
        std::move(channels), std::move(height), std::move(width), sampling_ratio, aligned)};
  }

  static variable_list backward(AutogradContext* /*ctx*/, const variable_list& /*grad_output*/) {
    no_double_backward("detops.roi_align", "_roi_align_backward");
  }
};

class RoIPoolFunction : public torch::autograd::Function<RoIPoolFunction> {
 public:
  static variable_list forward(
      AutogradContext* ctx, const Variable& input, const Variable& rois, double spatial_scale,
      c10::SymInt pooled_height, c10::SymInt pooled_width) {
    ctx->saved_data["spatial_scale"] = spatial_scale;
    ctx->saved_data["pooled_height"] = pooled_height;
    ctx->saved_data["pooled_width"] = pooled_width;
    ctx->saved_data["input_shape"] = input.sym_sizes();
    ctx->saved_data["input_dtype"] = input.scalar_type();
    ctx->saved_data["channels_last"] = channels_last_grad(input);
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [output, argmax] =
        roi_pool_op().call(input, rois, spatial_scale, std::move(pooled_height), std::move(pooled_width));
    ctx->save_for_backward({rois, argmax});
    ctx->mark_non_differentiable({argmax});
    // argmax never has a gradient: no zero tensor of its shape is made for the backward
    ctx->set_materialize_grads(false);
    return {output, argmax};
  }

  static variable_list backward(AutogradContext* ctx, const variable_list& grad_output) {
    variable_list grads(5);
    if (!ctx->needs_input_grad(0) || !grad_output[0].defined()) return grads;
    const auto saved = ctx->get_saved_variables();
    const Variable &rois = saved[0], &argmax = saved[1];
    const auto shape = saved_shape(ctx);
    grads[0] = input_grad(
        ctx, roi_pool_backward_op().call(
                 grad_output[0].to(rois.scalar_type()), rois, argmax, ctx->saved_data["spatial_scale"].toDouble(),
                 ctx->saved_data["pooled_height"].toSymInt(), ctx->saved_data["pooled_width"].toSymInt(),
                 shape[0], shape[1], shape[2], shape[3]));
    return grads;
  }
};

class RoIPoolBackwardFunction : public torch::autograd::Function<RoIPoolBackwardFunction> {
 public:
  static variable_list forward(
      AutogradContext* /*ctx*/, const Variable& grad, const Variable& rois, const Variable& argmax,
      double spatial_scale, c10::SymInt pooled_height, c10::SymInt pooled_width, c10::SymInt batch_size,
      c10::SymInt channels, c10::SymInt height, c10::SymInt width) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return {roi_pool_backward_op().call(
        grad, rois, argmax, spatial_scale, std::move(pooled_height), std::move(pooled_width), std::move(batch_size),
        std::move(channels), std::move(height), std::move(width))};
  }

  static variable_list backward(AutogradContext* /*ctx*/, const variable_list& /*grad_output*/) {
    no_double_backward("detops.roi_pool", "_roi_pool_backward");
  }
};

at::Tensor roi_align_autograd(
    const at::Tensor& input, const at::Tensor& rois, double spatial_scale, c10::SymInt pooled_height,
    c10::SymInt pooled_width, int64_t sampling_ratio, bool aligned) {
  if (at::GradMode::is_enabled() && (input.requires_grad() || rois.requires_grad())) {
    return RoIAlignFunction::apply(
        input, rois, spatial_scale, std::move(pooled_height), std::move(pooled_width), sampling_ratio, aligned)[0];
  }
  // no gradient to track: the kernels without a node, its saved values or their host time
  at::AutoDispatchBelowADInplaceOrView guard;
  return roi_align_op().call(
      input, rois, spatial_scale, std::move(pooled_height), std::move(pooled_width), sampling_ratio, aligned);
}

at::Tensor roi_align_backward_autograd(
    const at::Tensor& grad, const at::Tensor& rois, double spatial_scale, c10::SymInt pooled_height,
    c10::SymInt pooled_width, c10::SymInt batch_size, c10::SymInt channels, c10::SymInt height, c10::SymInt width,
    int64_t sampling_ratio, bool aligned) {
  return RoIAlignBackwardFunction::apply(
      grad, rois, spatial_scale, std::move(pooled_height), std::move(pooled_width), std::move(batch_size),
      std::move(channels), std::move(height), std::move(width), sampling_ratio, aligned)[0];
}

std::tuple<at::Tensor, at::Tensor> roi_pool_autograd(
    const at::Tensor& input, const at::Tensor& rois, double spatial_scale, c10::SymInt pooled_height,
    c10::SymInt pooled_width) {
  auto out = RoIPoolFunction::apply(input, rois, spatial_scale, std::move(pooled_height), std::move(pooled_width));
  return {out[0], out[1]};
}

// roi_pool's output alone. An input that needs a gradient goes through roi_pool's Function
// (argmax computed and saved for the backward); otherwise the kernels skip argmax altogether.
at::Tensor roi_pool_values_autograd(
    const at::Tensor& input, const at::Tensor& rois, double spatial_scale, c10::SymInt pooled_height,
    c10::SymInt pooled_width) {
  if (at::GradMode::is_enabled() && input.requires_grad()) {
    return RoIPoolFunction::apply(input, rois, spatial_scale, std::move(pooled_height), std::move(pooled_width))[0];
  }
  at::AutoDispatchBelowADInplaceOrView guard;
  return roi_pool_values_op().call(input, rois, spatial_scale, std::move(pooled_height), std::move(pooled_width));
}

at::Tensor roi_pool_backward_autograd(
    const at::Tensor& grad, const at::Tensor& rois, const at::Tensor& argmax, double spatial_scale,
    c10::SymInt pooled_height, c10::SymInt pooled_width, c10::SymInt batch_size, c10::SymInt channels,
    c10::SymInt height, c10::SymInt width) {
  return RoIPoolBackwardFunction::apply(
      grad, rois, argmax, spatial_scale, std::move(pooled_height), std::move(pooled_width), std::move(batch_size),
      std::move(channels), std::move(height), std::move(width))[0];
}

}  // namespace

TORCH_LIBRARY_IMPL(detops, Autograd, m) {
  m.impl("roi_align", TORCH_FN(roi_align_autograd));
  m.impl("_roi_align_backward", TORCH_FN(roi_align_backward_autograd));
  m.impl("roi_pool", TORCH_FN(roi_pool_autograd));
  m.impl("_roi_pool_values", TORCH_FN(roi_pool_values_autograd));
  m.impl("_roi_pool_backward", TORCH_FN(roi_pool_backward_autograd));
  // a copy the ops' backwards make; it has no gradient of its own
  m.impl("_to_channels_last", torch::autograd::autogradNotImplementedFallback());
}

}  // namespace ops
}  // namespace detops
