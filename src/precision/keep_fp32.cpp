#include "mixprec/precision/keep_fp32.h"

#include "precision/keep_record.h"

#include <c10/util/Exception.h>
#include <c10/util/intrusive_ptr.h>

#include <functional>
#include <mutex>
#include <unordered_map>

namespace mixprec {
namespace {

// Registry of TensorImpls the precision layer knows something about: a keep_in_fp32 mark, or
// the reason the last conversion kept it FP32. Each entry holds a weak reference: the registry
// must not keep a tensor alive, and a weak reference also keeps the TensorImpl's memory from
// being reused by another tensor while the entry exists, so an address can never be mistaken
// for a new tensor.
class MarkRegistry {
 public:
  struct Record {
    bool marked = false;
    KeptFp32 kept;
  };

  void update(const at::Tensor& t, const std::function<void(Record&)>& change) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = entries_.find(t.unsafeGetTensorImpl());
    if (it == entries_.end() || it->second.tensor.expired()) {
      Entry fresh{c10::weak_intrusive_ptr<c10::TensorImpl>(t.getIntrusivePtr()), {}};
      it = entries_.insert_or_assign(t.unsafeGetTensorImpl(), std::move(fresh)).first;
    }
    change(it->second.record);
    if (!it->second.record.marked && it->second.record.kept.reason == KeepReason::kNone) {
      entries_.erase(it);
    }
    if (entries_.size() >= 2 * live_after_sweep_ + 64) sweep_locked();
  }

  // The record of `t`; a default (unmarked, nothing kept) one if there is none.
  Record find(const at::Tensor& t) const {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = entries_.find(t.unsafeGetTensorImpl());
    return it != entries_.end() && !it->second.tensor.expired() ? it->second.record : Record{};
  }

 private:
  struct Entry {
    c10::weak_intrusive_ptr<c10::TensorImpl> tensor;
    Record record;
  };

  // Drops entries of destroyed tensors; amortized over insertions.
  void sweep_locked() {
    std::erase_if(entries_, [](const auto& kv) { return kv.second.tensor.expired(); });
    live_after_sweep_ = entries_.size();
  }

  mutable std::mutex mutex_;
  std::unordered_map<const c10::TensorImpl*, Entry> entries_;
  size_t live_after_sweep_ = 0;
};

MarkRegistry& registry() {
  static MarkRegistry* instance = new MarkRegistry();  // never destroyed: safe at exit
  return *instance;
}

}  // namespace

at::Tensor keep_in_fp32(at::Tensor tensor) {
  TORCH_CHECK(tensor.defined(), "[mixprec::keep_in_fp32] the tensor is undefined");
  // LibTorch counts FP8 dtypes as floating; an FP8 tensor is quantized by definition, and a
  // mark on it would report it "kept FP32" while it stays FP8.
  TORCH_CHECK(at::isFloatingType(tensor.scalar_type()) && !at::isFloat8Type(tensor.scalar_type()),
              "[mixprec::keep_in_fp32] only high-precision floating-point tensors can be kept in "
              "FP32 (an FP8 tensor is quantized already); got a ",
              tensor.scalar_type(), " tensor of shape ", tensor.sizes());
  registry().update(tensor, [](MarkRegistry::Record& r) { r.marked = true; });
  return tensor;
}

bool is_kept_in_fp32(const at::Tensor& tensor) {
  return tensor.defined() && registry().find(tensor).marked;
}

void clear_keep_in_fp32(const at::Tensor& tensor) {
  if (tensor.defined())
    registry().update(tensor, [](MarkRegistry::Record& r) { r.marked = false; });
}

namespace detail {

void record_conversion_keep(const at::Tensor& tensor, KeepReason reason, std::string rule) {
  TORCH_INTERNAL_ASSERT(tensor.defined());
  registry().update(tensor, [&](MarkRegistry::Record& r) {
    r.kept = reason == KeepReason::kNone ? KeptFp32{} : KeptFp32{reason, std::move(rule)};
  });
}

KeptFp32 conversion_keep(const at::Tensor& tensor) {
  return tensor.defined() ? registry().find(tensor).kept : KeptFp32{};
}

}  // namespace detail

bool is_kept_fp32_by_mark_or_plan(const at::Tensor& tensor) {
  if (!tensor.defined()) return false;
  const MarkRegistry::Record record = registry().find(tensor);
  return record.marked || record.kept.reason != KeepReason::kNone;
}
}  // namespace mixprec
