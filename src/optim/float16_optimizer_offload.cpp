// Float16Optimizer with offloading: the active parameters' steps run through one
// OffloadPipeline per device (optim/offload.h). Which parameters step, with which multiplier,
// is decided by update() exactly as without offloading; this only moves the work to the host.
#include "mixprec/optim/float16_optimizer.h"

#include "optim/offload/offload_pipeline.h"
#include "optim/optimizer_slot.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <iterator>

namespace mixprec::optim {

void Float16Optimizer::step_offloaded(const std::vector<size_t>& active, double grad_multiplier) {
  TORCH_INTERNAL_ASSERT(options_.offload());
  offload_stats_ = OffloadStats();
  std::vector<c10::Device> devices;  // in the order parameters first use them
  for (size_t k : active) {
    const c10::Device d = slots_[k]->param.device();
    if (std::find(devices.begin(), devices.end(), d) == devices.end()) devices.push_back(d);
  }
  // Everything a step creates, for every device — new state and the pipelines' staging
  // memory — before any pipeline runs (as update() does without offloading): running out of
  // memory for it leaves every parameter, its state and its step count as they were.
  struct DeviceWork {
    detail::OffloadPipeline* pipeline = nullptr;
    std::vector<size_t> stepped;
    std::vector<detail::OffloadItem> items;
    std::vector<std::vector<at::Tensor>> whole_state;  // committed once every chunk is done
  };
  std::vector<DeviceWork> work(devices.size());
  std::vector<size_t> without_piece;  // counted all the same, once the steps are done
  for (size_t d = 0; d < devices.size(); ++d) {
    const c10::Device device = devices[d];
    auto found = std::find_if(offload_.begin(), offload_.end(),
                              [&](const auto& pipeline) { return pipeline->device() == device; });
    if (found == offload_.end()) {
      offload_.push_back(
          std::make_unique<detail::OffloadPipeline>(*options_.offload(), device, who_.c_str()));
      found = std::prev(offload_.end());
    }
    work[d].pipeline = found->get();
    for (size_t k : active) {
      Slot& s = *slots_[k];
      if (s.param.device() != device) continue;
      if (s.begin == s.end) {  // no piece here
        without_piece.push_back(k);
        continue;
      }
      const auto& options = param_groups()[info_[k].group].options();
      detail::OffloadItem item;
      item.grad = step_grads_[k].view({-1});
      item.param = s.piece().view({-1});
      item.param_down = !s.master.defined();  // native FP32, or the remainder's high half
      if (s.master.defined()) item.master = s.master.view({-1});
      if (s.remainder.defined()) item.remainder = s.remainder.view({-1});
      std::vector<at::Tensor> state = s.state;
      item.fresh = traits_->allocate_state(options, s.piece_sizes(), c10::kCPU, state);
      for (const at::Tensor& t : state) item.state.push_back(t.defined() ? t.view({-1}) : t);
      item.options = &options;
      item.steps_before = s.step;
      work[d].items.push_back(std::move(item));
      work[d].whole_state.push_back(std::move(state));
      work[d].stepped.push_back(k);
    }
    work[d].pipeline->prepare(work[d].items);  // its staging memory, before any device steps
  }
  for (DeviceWork& w : work) {
    const OffloadStats stats = w.pipeline->run(*traits_, w.items, grad_multiplier);
    for (size_t i = 0; i < w.stepped.size(); ++i) {
      Slot& s = *slots_[w.stepped[i]];
      s.state = std::move(w.whole_state[i]);
      ++s.step;
    }
    offload_stats_.chunks += stats.chunks;
    offload_stats_.bytes_down += stats.bytes_down;
    offload_stats_.bytes_up += stats.bytes_up;
    offload_stats_.wall_seconds += stats.wall_seconds;
    offload_stats_.step_seconds += stats.step_seconds;
    offload_stats_.copy_seconds += stats.copy_seconds;
  }
  for (size_t k : without_piece) ++slots_[k]->step;
}

}  // namespace mixprec::optim
