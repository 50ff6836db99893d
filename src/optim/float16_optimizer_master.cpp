// How a Float16Optimizer slot holds its main copy: an FP32 master, or the BF16 parameter plus
// an int16 remainder (master_remainders); on the parameter's device, or on the host (offload).
// Every place that creates, reads or rewrites a main copy goes through these, so the forms and
// devices are handled once.
#include "mixprec/optim/float16_optimizer.h"

#include "mixprec/optim/fused_kernels.h"
#include "mixprec/optim/master_remainder.h"
#include "optim/optimizer_slot.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

namespace mixprec::optim {

detail::MasterPolicy Float16Optimizer::master_policy() const {
  return {options_.master_remainders(), options_.offload().has_value()};
}

at::Tensor Float16Optimizer::Slot::piece() const {
  const at::Tensor p = param.detach();
  if (whole) return p;
  return p.view({-1}).narrow(0, begin, end - begin);
}

std::vector<int64_t> Float16Optimizer::Slot::piece_sizes() const {
  if (whole) return param.sizes().vec();
  return {end - begin};
}

at::Tensor Float16Optimizer::Slot::master_value() const {
  if (master.defined() || !remainder.defined()) return master;
  // The parameter's BF16 bits are the high half; a parameter re-typed from outside since
  // (BF16 → FP32/FP16) gives them back by conversion (see float16_optimizer.h for when exactly).
  const at::Tensor high = piece().to(remainder.device(), at::kBFloat16);
  at::Tensor value = join_master(high, remainder);
  // Shares the remainder's version counter: a step after this value was taken bumps it, so a
  // checkpoint saver sees the snapshot is stale, as it would on an alias of an FP32 master.
  if (!value.is_inference() && !remainder.is_inference()) {
    value.unsafeGetTensorImpl()->set_version_counter(
        remainder.unsafeGetTensorImpl()->version_counter());
  }
  return value;
}

void Float16Optimizer::Slot::hold_master(const at::Tensor& value,
                                         const detail::MasterPolicy& policy) {
  at::NoGradGuard no_grad;
  const at::Tensor p = piece();
  const c10::Device where = policy.state_device(p);
  const auto on = [&](at::ScalarType dtype) {
    return at::TensorOptions().dtype(dtype).device(where);
  };
  if (policy.wants_remainder(p)) {
    if (!remainder.defined() || remainder.sizes() != p.sizes() || remainder.device() != where) {
      remainder = at::empty(p.sizes(), on(at::kShort));
    }
    if (!value.defined()) {
      remainder.zero_();  // master = the BF16 parameter exactly
    } else {
      const at::Tensor v = value.detach().to(where, at::kFloat).contiguous();
      if (p.device() == where) {
        split_master_out(v, p, remainder);
      } else {
        const at::Tensor high = at::empty(p.sizes(), on(at::kBFloat16));
        split_master_out(v, high, remainder);
        p.copy_(high);
      }
    }
    master = at::Tensor();
    return;
  }
  remainder = at::Tensor();
  if (!master.defined() || master.sizes() != p.sizes() || master.device() != where) {
    master = at::empty(p.sizes(), on(at::kFloat));
  } else if (value.defined() && value.is_same(master)) {
    write_param_from_master();
    return;
  }
  if (!value.defined()) {
    master.copy_(p);  // exact: BF16/FP16 → FP32, and RNE gives the parameter back
    return;
  }
  master.copy_(value.detach());
  write_param_from_master();
}

void Float16Optimizer::Slot::drop_master() {
  master = at::Tensor();
  remainder = at::Tensor();
}

void Float16Optimizer::Slot::write_param_from_master() const {
  if (!master.defined()) return;
  at::NoGradGuard no_grad;
  const at::Tensor p = piece();
  if (master.device() == p.device()) {
    copy_master_to_model(master, p);
    return;
  }
  // Offloaded: round on the host (the kernel's RNE), then one copy to the device.
  const at::Tensor rounded = at::empty(p.sizes(), p.options().device(master.device()));
  copy_master_to_model(master, rounded);
  p.copy_(rounded);
}

}  // namespace mixprec::optim
