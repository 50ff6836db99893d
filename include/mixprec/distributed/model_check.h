// Every rank must hold the same model before anything is reduced or sharded.
//
// A rank whose parameters differ in name, order, shape, dtype or trainability would reduce
// gradients into the wrong places, or call collectives of other sizes and hang. The check
// runs first, as the first collective a GradReducer issues: every rank all-gathers every
// rank's description (lengths, then bytes), so every rank reaches the same verdict and raises
// the same error.
#pragma once

#include "mixprec/distributed/communicator.h"

#include <string>

namespace torch::nn {
class Module;
}

namespace mixprec::distributed {

// One line per parameter, in named_parameters() order: "<fqn> <dtype> [d0, d1, ...] trainable"
// (or "frozen").
std::string model_description(const torch::nn::Module& model);

// Collective. Throws c10::Error on every rank when any rank's description differs from rank
// 0's, naming the first differing parameter (by rank 0's FQN, or the other rank's where rank
// 0 has fewer parameters) and both ranks' entries for it.
void check_same_model(Communicator& comm, const torch::nn::Module& model);

}  // namespace mixprec::distributed
