// Hyper-parameters of the inner optimizer algorithms, with torch.optim's names and defaults.
//
// Plain structs (no LibTorch types beyond c10::Error in the checks), shared by the fused kernels
// (optim/fused_kernels.h), the master-remainder steps (optim/master_remainder.h) and the
// optimizer that reads them from its param groups (optim/float16_optimizer.h).
#pragma once

namespace mixprec::optim {

// torch.optim.Adam / AdamW hyper-parameters: the same names, and torch.optim.Adam's defaults
// (weight_decay 0, where torch.optim.AdamW's is 1e-2), with decoupled_weight_decay true.
struct AdamHyperParams {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  bool decoupled_weight_decay = true;  // AdamW: param *= 1 - lr * weight_decay
  bool amsgrad = false;                // keep max_exp_avg_sq and use it in the denominator
  bool maximize = false;               // ascend: negate the gradient
};

// torch.optim.SGD hyper-parameters.
struct SgdHyperParams {
  double lr = 1e-3;
  double momentum = 0.0;
  double dampening = 0.0;
  double weight_decay = 0.0;
  bool nesterov = false;
  bool maximize = false;
};

// Throw c10::Error naming the hyper-parameter if it is outside the range torch.optim accepts
// (negative lr/eps/weight decay, betas outside [0, 1), nesterov without plain momentum).
// The step functions run these too; callers use them to validate before changing anything.
void check_hyper_params(const AdamHyperParams& hp);
void check_hyper_params(const SgdHyperParams& hp);

}  // namespace mixprec::optim
