// Selective conversion: cast a module to BF16/FP16 except what the precision plan keeps FP32.
#pragma once

#include "mixprec/precision/precision_plan.h"

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <string>
#include <vector>

namespace torch::nn {
class Module;
}

namespace mixprec {

// What the conversion did to one tensor.
enum class ConversionAction {
  kCast,        // floating, not kept: cast to the target half dtype
  kKeptFp32,    // kept by the plan and already FP32: untouched
  kUpcastFp32,  // kept by the plan but was not FP32 (e.g. after Module::to(kBFloat16), or
                // FP64): now FP32
  kLeftAlone,   // integer/bool buffers, FP8 primary weights, tensors already in the target dtype
};

const char* to_string(ConversionAction action);

struct ConversionEntry {
  std::string name;
  TensorKind kind;
  c10::ScalarType before;
  c10::ScalarType after;
  ConversionAction action;
  KeepReason reason;  // why it stays FP32 (kNone unless kKeptFp32/kUpcastFp32)
  std::string why;    // human-readable reason, e.g. "pattern '*norm*'" or "int64 buffer"
  int64_t numel = 0;
  bool shared = false;  // tied to an earlier entry: converted once, counted once
};

struct ConversionReport {
  c10::ScalarType target;
  std::vector<ConversionEntry> entries;         // parameters first, then buffers, module order
  std::vector<std::string> unmatched_patterns;  // non-strict plans only
  int64_t bytes_before = 0;  // all defined parameters and buffers, tied tensors once
  int64_t bytes_after = 0;

  int64_t count(ConversionAction action) const;
  // A table: name, kind, dtype before -> after, why; then the byte totals.
  std::string to_string() const;
};

// Casts every floating parameter and buffer of `module` (recursively) to `dtype` except those
// `plan` keeps in FP32, which end FP32 whatever they were. Integer and bool buffers are left
// alone (unlike Module::to), as are FP8 tensors (quantized primary weights, quant.h).
//
// In place: every tensor keeps its identity (TensorImpl), so references held elsewhere — an
// optimizer's param list, a keep_in_fp32 mark — stay valid; a defined .grad() is cast with
// its parameter. `dtype` must be kHalf or kBFloat16.
//
// Throws c10::Error before changing anything if `dtype` is not a half type or the plan does
// not resolve against the module (see PrecisionPlan::resolve). Tensors are cast one at a time
// to bound peak memory, so an allocation failure part-way leaves earlier tensors converted.
ConversionReport convert_module_to_dtype_except_fp32_marked(torch::nn::Module& module,
                                                            c10::ScalarType dtype,
                                                            const PrecisionPlan& plan = {});

// Why a conversion kept a tensor FP32: the plan rule (a keep_in_fp32 mark, a name, a pattern)
// and, for a name or pattern, its text.
struct KeptFp32 {
  KeepReason reason = KeepReason::kNone;
  std::string rule;  // the name or pattern that matched; empty for a mark
};

// What the most recent conversion of `tensor` (this function or Float16Module) recorded:
// why it kept the tensor FP32, or {kNone, ""} if it cast it, left it alone (integer, FP8), or
// no conversion has seen it. The record belongs to the tensor object, like a keep_in_fp32
// mark: it survives Module::to, torch::load into the module and clone_module, and a later
// conversion replaces it. model_sharded_state_dict saves it (common "precision").
KeptFp32 kept_fp32_reason(const at::Tensor& tensor);

// True if `tensor` stays FP32 by any of the plan's mechanisms: it is marked keep_in_fp32, or
// the most recent conversion kept it (by name or pattern). One registry lookup (forward paths
// ask it at every call).
bool is_kept_fp32_by_mark_or_plan(const at::Tensor& tensor);

}  // namespace mixprec
