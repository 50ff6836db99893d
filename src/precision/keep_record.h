// The process-wide record of what the precision layer knows about a tensor object: its
// keep_in_fp32 mark, and why the most recent conversion kept it FP32. One registry keyed by
// TensorImpl (keep_fp32.cpp) serves both, so both survive what a mark survives.
#pragma once

#include "mixprec/precision/convert.h"

#include <ATen/core/Tensor.h>

#include <string>

namespace mixprec::detail {

// Records that a conversion kept `tensor` FP32 because of `reason` (`rule`: the name or
// pattern that matched, empty for a mark). kNone erases the record: the conversion cast it.
void record_conversion_keep(const at::Tensor& tensor, KeepReason reason, std::string rule);

// What the most recent conversion recorded for `tensor` (kNone if nothing).
KeptFp32 conversion_keep(const at::Tensor& tensor);

}  // namespace mixprec::detail
