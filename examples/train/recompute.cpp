#include "recompute.h"

#include "gpt.h"

#include "mixprec/quant/quant_state.h"

#include <ATen/core/grad_mode.h>
#include <ATen/record_function.h>
#include <torch/autograd.h>
#include <torch/custom_class.h>

namespace train {
namespace {

// The block, held by the autograd graph between forward and backward.
struct BlockHolder : torch::CustomClassHolder {
  explicit BlockHolder(std::shared_ptr<BlockImpl> block) : block(std::move(block)) {}
  std::shared_ptr<BlockImpl> block;
};

// The MoE counts the tokens each expert received in forward; the recomputation must not count
// them a second time (the expert-bias update would see twice the load).
class [[nodiscard]] NoLoadCounting {
 public:
  explicit NoLoadCounting(MoEImpl& moe) : moe_(moe), was_(moe.counts_load) {
    moe_.counts_load = false;
  }
  ~NoLoadCounting() { moe_.counts_load = was_; }
  NoLoadCounting(const NoLoadCounting&) = delete;
  NoLoadCounting& operator=(const NoLoadCounting&) = delete;

 private:
  MoEImpl& moe_;
  bool was_;
};

struct RecomputedBlock : torch::autograd::Function<RecomputedBlock> {
  // Function::apply runs this with grad mode off: the block keeps nothing for backward.
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                const at::Tensor& x,
                                                std::shared_ptr<BlockImpl> block) {
    const mixprec::quant::QuantScopeState quant = mixprec::quant::autocast_state();
    ctx->saved_data["quant_enabled"] = quant.enabled;
    ctx->saved_data["quant_format"] = static_cast<int64_t>(quant.format);
    ctx->save_for_backward({x});
    auto [y, aux] = block->forward(x);
    ctx->saved_data["block"] = c10::IValue::make_capsule(c10::make_intrusive<BlockHolder>(block));
    return {y, aux};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    RECORD_USER_SCOPE("mixprec::recompute");
    // Grad mode is on here only for a backward that builds a graph of its own (create_graph):
    // the gradients below are computed without one, so a second derivative would be wrong.
    TORCH_CHECK(!at::GradMode::is_enabled(),
                "[mixprec-train] --recompute does not support double backward (create_graph)");
    const auto holder = ctx->saved_data["block"].toCapsule();
    BlockImpl& block = *static_cast<BlockHolder*>(holder.get())->block;
    const at::Tensor x = ctx->get_saved_variables()[0].detach().requires_grad_(true);
    // Autograd runs backward on its own thread for other devices: the scope is this thread's,
    // so it is set from what forward recorded rather than read.
    const mixprec::quant::QuantAutocastGuard quant(
        ctx->saved_data["quant_enabled"].toBool(),
        static_cast<mixprec::quant::QuantFormat>(ctx->saved_data["quant_format"].toInt()));
    const NoLoadCounting no_count(*block.moe);
    const at::AutoGradMode grad_on(true);
    auto [y, aux] = block.forward(x);
    std::vector<at::Tensor> outputs, output_grads;
    for (auto [out, grad] : {std::pair{y, grads[0]}, std::pair{aux, grads[1]}}) {
      if (grad.defined() && out.requires_grad()) {
        outputs.push_back(out);
        output_grads.push_back(grad);
      }
    }
    if (!outputs.empty()) torch::autograd::backward(outputs, output_grads);
    return {x.grad(), at::Tensor()};
  }
};

}  // namespace

std::tuple<at::Tensor, at::Tensor> forward_recomputed_in_backward(BlockImpl& block,
                                                                  const at::Tensor& x) {
  if (!at::GradMode::is_enabled() || !x.requires_grad()) return block.forward(x);
  auto self = std::dynamic_pointer_cast<BlockImpl>(block.shared_from_this());
  const torch::autograd::variable_list out = RecomputedBlock::apply(x, std::move(self));
  return {out[0], out[1]};
}

}  // namespace train
