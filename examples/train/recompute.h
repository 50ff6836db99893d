// Activation recomputation (--recompute): a block's forward runs without keeping anything for
// backward but its input, and runs again, with autograd on, when backward reaches the block.
// Memory kept for backward falls from every block's activations to one block's plus each
// block's input; the price is a second forward per block.
//
// LibTorch has no torch.utils.checkpoint, so this is a custom autograd function (the reentrant
// form): its backward recomputes the block and runs autograd on that piece of graph, which
// accumulates the block parameters' gradients (their hooks fire, so data parallelism's
// reduction sees them as it would) and returns the input's gradient. The recomputation sees
// what the first forward saw: the same weights, the FP8 autocast scope recorded at forward,
// and no second count of the tokens each expert received. Every kernel is deterministic on
// CPU, so the recomputed activations, and with them the gradients and the whole loss curve,
// are bitwise those of a run without --recompute (tests/train/model_test.cpp, train_run_test).
// The limits of this (reentrant) form: no double backward (create_graph), which it refuses;
// autograd::grad over the loss still fills the block parameters' .grad (the inner backward
// accumulates into them); and RNG state is not replayed (the model draws no random numbers).
#pragma once

#include <ATen/core/Tensor.h>

#include <tuple>

namespace train {

struct BlockImpl;

// block.forward(x), recomputed in backward. Falls back to the plain forward when nothing needs
// a gradient (grad mode off, or x not requiring grad: the function's backward would never run
// and the block's parameters would get no gradient).
std::tuple<at::Tensor, at::Tensor> forward_recomputed_in_backward(BlockImpl& block,
                                                                  const at::Tensor& x);

}  // namespace train
