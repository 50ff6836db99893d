// Data parallelism in mixprec-train: what the loop agrees on across ranks.
//
// Under `torchrun --nproc-per-node N --no-python mixprec-train …` every rank builds the same
// model from the seed, takes rows [rank·B/N, (rank+1)·B/N) of every global batch of B rows, and
// the ZeRO-1 optimizer (optimizer.h: make_data_parallel_optimizer) averages gradients. What
// the ranks must also share goes through these helpers: the logged losses (a mean over ranks:
// the global batch's), the experts' token counts (summed, so every rank moves its expert biases
// exactly as one process seeing the whole batch would), and the decision to stop (a signal that
// reached one rank stops every rank after the same step). `ranks` null: one process, no-ops.
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <vector>

namespace mixprec::distributed {
class Communicator;
}

namespace train {

// The launcher's ranks (torchrun's environment, checked), or null without a launcher.
// Collective when launched: every rank joins the process group here.
std::shared_ptr<mixprec::distributed::Communicator> join_ranks();

// The mean of `value` over ranks.
double mean_over_ranks(mixprec::distributed::Communicator* ranks, double value);
// What the ranks agree on after every step, in one all-reduce: the mean of the step's loss and
// load-balancing loss, whether any rank was asked to stop and by which signal (SIGTERM if
// any rank got one, else SIGINT: the two StopRequest answers), and (in place) every MoE layer's
// token counts summed. One collective instead of 3 + layers, each a round trip.
struct StepAgreement {
  double loss = 0;
  double aux_loss = 0;
  int stop_signal = 0;  // 0: no rank was asked to stop
};
StepAgreement agree_on_step(mixprec::distributed::Communicator* ranks, StepAgreement mine,
                            const std::vector<at::Tensor>& expert_loads);

}  // namespace train
