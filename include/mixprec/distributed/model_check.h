// Every rank must hold the same model before anything is reduced or sharded.
//
// A rank whose parameters differ in name, order, shape, dtype, trainability, tying (which
// tensors are one), contiguity or device type, or whose buffers differ, would reduce gradients into
// the wrong places, broadcast into tensors of other sizes, or call collectives of other sizes and
// hang. The check runs first, as the first collective a GradReducer issues: every rank all-gathers
// every rank's description (lengths, then bytes), so every rank reaches the same verdict and raises
// the same error.
#pragma once

#include "mixprec/distributed/communicator.h"

#include <string>

namespace torch::nn {
class Module;
}

namespace mixprec::distributed {

// One line per parameter, in named_parameters() order: "<fqn> <dtype> [d0, d1, ...] trainable"
// (or "frozen"), followed by " tied to '<first fqn>'" for a second name of one tensor; then one
// line per buffer: "buffer <fqn> <dtype> [d0, ...]". After the shape, where they apply: the
// layout if not strided, " non-contiguous", and " on <device type>" off the CPU.
std::string model_description(const torch::nn::Module& model);

// Collective. Throws c10::Error on every rank when any rank's description differs from rank
// 0's, naming what differs: the names one rank has and the other lacks, else the first
// parameter or buffer (in rank 0's order) whose entry differs, with both ranks' entries, else
// the first position where the order differs.
void check_same_model(Communicator& comm, const torch::nn::Module& model);

// Collective, after check_same_model. Throws c10::Error on every rank when a parameter or buffer
// holds other values (XXH3-64 of its bytes) on some rank than on rank 0, naming the first
// such tensor in rank 0's order and the rank. For GradReducer without broadcast_from_rank0:
// ranks that start from different weights would train apart.
void check_same_values(Communicator& comm, const torch::nn::Module& model);

}  // namespace mixprec::distributed
