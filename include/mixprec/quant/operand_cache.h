// OperandCache: a tensor derived from other tensors (QuantLinear's fake-quantized or
// dequantized weight), recomputed only when one of its sources may have changed.
//
// A weight changes at optimizer steps, yet its quantized GEMM operand was recomputed on every
// forward. The cache keeps the last result together with what identifies each source's
// contents at the time:
//   * the tensor and its storage, by weak reference (a freed tensor or storage can never match
//     a new one that happens to reuse its address);
//   * data pointer, storage offset, sizes, strides and dtype (set_data swaps these without
//     bumping the version);
//   * the version counter, which every in-place write through the tensor or any view of it
//     bumps: optimizer steps (mixprec's fused kernels bump it for their raw-pointer writes),
//     copy_ and load_state_dict-style loads, in-place ops, with or without grad mode;
//   * the caller's recipe (what was computed: format and dtype).
// Any difference means a recomputation, so a cached result always equals recomputing it.
// Not seen, by design of LibTorch: writes through Tensor::data() (which gets a fresh version
// counter) or through raw data pointers without bump_version. Call clear() after such a write.
// Inference tensors have no version counter: a source that is one is never cached.
//
// Thread-safe: get() and clear() may be called from several threads at once; a get() that
// has to compute holds the cache while it does, so the others wait and then share its result.
#pragma once

#include "mixprec/quant/quant_config.h"

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <c10/util/intrusive_ptr.h>

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <mutex>
#include <vector>

namespace mixprec::quant {

// What a cached operand was computed as.
struct OperandRecipe {
  QuantFormat format = QuantFormat::kNone;  // quantization applied to it
  c10::ScalarType dtype = at::kFloat;       // its dtype
  friend bool operator==(const OperandRecipe&, const OperandRecipe&) = default;
};

class OperandCache {
 public:
  OperandCache() = default;
  // A copy starts empty: a cloned module must recompute from its own tensors.
  OperandCache(const OperandCache&) {}
  OperandCache& operator=(const OperandCache&) {
    clear();
    return *this;
  }

  // The cached result if it was computed by `recipe` from `sources` exactly as they are now
  // (and has not been written to since); otherwise compute() (called under NoGradGuard,
  // and outside InferenceMode when the result can be kept), remembered and returned. Callers must
  // not write to the result. Sources must be defined; compute() must be a function of their
  // contents and the recipe only.
  at::Tensor get(std::initializer_list<at::Tensor> sources, const OperandRecipe& recipe,
                 const std::function<at::Tensor()>& compute);

  // Forgets the cached result.
  void clear();

  // How many times get() has called compute() (for tests and benchmarks).
  int64_t computations() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return computations_;
  }

 private:
  // What identifies a source's contents (see above), recorded from `t`.
  struct SourceKey {
    explicit SourceKey(const at::Tensor& t);
    bool matches(const at::Tensor& t) const;

    c10::weak_intrusive_ptr<c10::TensorImpl> tensor;
    c10::weak_intrusive_ptr<c10::StorageImpl> storage;
    const void* data;
    int64_t storage_offset;
    std::vector<int64_t> sizes, strides;
    c10::ScalarType dtype;
    int64_t version;
  };

  void clear_locked();

  mutable std::mutex mutex_;  // guards everything below
  std::vector<SourceKey> sources_;
  OperandRecipe recipe_;
  at::Tensor value_;
  int64_t value_version_ = 0;
  int64_t computations_ = 0;
};

}  // namespace mixprec::quant
