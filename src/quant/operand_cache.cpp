#include "mixprec/quant/operand_cache.h"

#include <ATen/core/grad_mode.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <optional>

namespace mixprec::quant {
namespace {

// Only tensors with a version counter and a storage can be recognized again.
bool identifiable(const at::Tensor& t) {
  return t.defined() && !t.is_inference() && t.has_storage();
}

}  // namespace

OperandCache::SourceKey::SourceKey(const at::Tensor& t)
    : tensor(t.getIntrusivePtr()),
      storage(t.storage().getWeakStorageImpl()),
      data(t.const_data_ptr()),
      storage_offset(t.storage_offset()),
      sizes(t.sizes().vec()),
      strides(t.strides().vec()),
      dtype(t.scalar_type()),
      version(t._version()) {}

// The weak references keep the TensorImpl and StorageImpl objects allocated (not their data),
// so an address that still matches is the same object, never a new one in its place.
bool OperandCache::SourceKey::matches(const at::Tensor& t) const {
  return tensor._unsafe_get_target() == t.unsafeGetTensorImpl() &&
         storage._unsafe_get_target() == t.storage().unsafeGetStorageImpl() &&
         data == t.const_data_ptr() && storage_offset == t.storage_offset() &&
         t.sizes().equals(sizes) && t.strides().equals(strides) && dtype == t.scalar_type() &&
         version == t._version();
}

at::Tensor OperandCache::get(std::initializer_list<at::Tensor> sources, const OperandRecipe& recipe,
                             const std::function<at::Tensor()>& compute) {
  std::lock_guard<std::mutex> lock(mutex_);
  const bool cacheable = std::all_of(sources.begin(), sources.end(), identifiable);
  if (cacheable && value_.defined() && recipe_ == recipe && sources_.size() == sources.size() &&
      value_._version() == value_version_ &&
      std::equal(sources_.begin(), sources_.end(), sources.begin(),
                 [](const SourceKey& k, const at::Tensor& t) { return k.matches(t); })) {
    return value_;
  }
  clear_locked();
  std::vector<SourceKey> keys;
  if (cacheable) {
    // Recorded before compute(): what the result is computed from.
    for (const at::Tensor& t : sources) keys.emplace_back(t);
  }
  at::Tensor value;
  {
    at::NoGradGuard no_grad;
    // Under InferenceMode the result would be an inference tensor, which has no version
    // counter to tell a later write; computed as a normal tensor it can be kept.
    std::optional<c10::InferenceMode> normal_tensors;
    if (cacheable) normal_tensors.emplace(false);
    value = compute();
  }
  TORCH_INTERNAL_ASSERT(value.defined(), "OperandCache: compute() returned no tensor");
  ++computations_;
  if (cacheable && !value.is_inference()) {
    sources_ = std::move(keys);
    recipe_ = recipe;
    value_ = value;
    value_version_ = value._version();
  }
  return value;
}

void OperandCache::clear() {
  std::lock_guard<std::mutex> lock(mutex_);
  clear_locked();
}

void OperandCache::clear_locked() {
  sources_.clear();
  value_ = at::Tensor();
  value_version_ = 0;
}

}  // namespace mixprec::quant
