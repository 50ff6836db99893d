#include "mixprec/precision/keep_fp32.h"

#include <c10/util/Exception.h>
#include <c10/util/intrusive_ptr.h>

#include <mutex>
#include <unordered_map>

namespace mixprec {
namespace {

// Registry of marked TensorImpls. Each entry holds a weak reference: the mark must not keep a
// tensor alive, and a weak reference also keeps the TensorImpl's memory from being reused by
// another tensor while the entry exists, so an address can never be mistaken for a new tensor.
class MarkRegistry {
 public:
  void add(const at::Tensor& t) {
    std::lock_guard<std::mutex> lock(mutex_);
    marks_.insert_or_assign(t.unsafeGetTensorImpl(),
                            c10::weak_intrusive_ptr<c10::TensorImpl>(t.getIntrusivePtr()));
    if (marks_.size() >= 2 * live_after_sweep_ + 64) sweep_locked();
  }

  bool contains(const at::Tensor& t) const {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = marks_.find(t.unsafeGetTensorImpl());
    return it != marks_.end() && !it->second.expired();
  }

  void remove(const at::Tensor& t) {
    std::lock_guard<std::mutex> lock(mutex_);
    marks_.erase(t.unsafeGetTensorImpl());
  }

 private:
  // Drops entries of destroyed tensors; amortized over insertions.
  void sweep_locked() {
    std::erase_if(marks_, [](const auto& kv) { return kv.second.expired(); });
    live_after_sweep_ = marks_.size();
  }

  mutable std::mutex mutex_;
  std::unordered_map<const c10::TensorImpl*, c10::weak_intrusive_ptr<c10::TensorImpl>> marks_;
  size_t live_after_sweep_ = 0;
};

MarkRegistry& registry() {
  static MarkRegistry* instance = new MarkRegistry();  // never destroyed: safe at exit
  return *instance;
}

}  // namespace

at::Tensor keep_in_fp32(at::Tensor tensor) {
  TORCH_CHECK(tensor.defined(), "[mixprec::keep_in_fp32] the tensor is undefined");
  TORCH_CHECK(at::isFloatingType(tensor.scalar_type()),
              "[mixprec::keep_in_fp32] only floating-point tensors can be kept in FP32; got a ",
              tensor.scalar_type(), " tensor of shape ", tensor.sizes());
  registry().add(tensor);
  return tensor;
}

bool is_kept_in_fp32(const at::Tensor& tensor) {
  return tensor.defined() && registry().contains(tensor);
}

void clear_keep_in_fp32(const at::Tensor& tensor) {
  if (tensor.defined()) registry().remove(tensor);
}

}  // namespace mixprec
