// Private: hyper-parameters read from LibTorch's option types at every step (so LR schedulers
// and group.options().set_lr() work). Same mapping as the single-process optimizer's; to be
// folded into the optimizer's traits table.
#pragma once

#include "mixprec/optim/float16_optimizer.h"

namespace mixprec::dist::detail {

// AdamWOptions → kAdamW, AdamOptions → kAdam, SGDOptions → kSgd; c10::Error naming `who` and
// the type otherwise.
optim::Algorithm algorithm_of(const torch::optim::OptimizerOptions& options, const char* who);
optim::AdamHyperParams adam_hyper_params(const torch::optim::OptimizerOptions& options,
                                         optim::Algorithm algorithm);
optim::SgdHyperParams sgd_hyper_params(const torch::optim::OptimizerOptions& options);
const char* algorithm_name(optim::Algorithm algorithm);

}  // namespace mixprec::dist::detail
