// Marking individual tensors "keep in FP32".
//
// A mark belongs to the tensor object (its TensorImpl), not to a Python-style attribute or a
// name, so it survives everything LibTorch does to a module's tensors without replacing the
// object: `Module::to(device)` and `to(dtype)` (both go through `set_data`, which keeps the
// TensorImpl even when new storage is allocated), `torch::load` into an existing module,
// and mixprec's own conversion. Parameters and buffers are treated alike — the bug that
// Megatron's attribute-based mark has with buffers on `.cuda()` cannot happen here.
//
// `Module::clone()` builds new tensors by calling `reset()`; marks made inside `reset()`
// (the way LibTorch modules create their tensors) are therefore made again on the copy.
// For marks made elsewhere, use `mixprec::clone_module` (module_clone.h), which carries them.
// Marks by name or pattern live in a `PrecisionPlan` (precision_plan.h) and need none of this.
#pragma once

#include <ATen/core/Tensor.h>

namespace mixprec {

// Marks `tensor` to stay FP32 through mixprec's conversions and returns it (the same handle,
// so `register_parameter("w", keep_in_fp32(torch::randn({4})))` works).
// Throws c10::Error if `tensor` is undefined or its dtype is not floating point, or is FP8.
// The mark is thread-safe and is dropped automatically when the tensor is destroyed.
at::Tensor keep_in_fp32(at::Tensor tensor);

// True if `tensor` (the same TensorImpl) was marked with keep_in_fp32. Undefined → false.
bool is_kept_in_fp32(const at::Tensor& tensor);

// Removes a mark; a tensor that is not marked is left as it is.
void clear_keep_in_fp32(const at::Tensor& tensor);

}  // namespace mixprec
