// Shared pieces of the multi-process tests (distributed_mp_tests): every rank started by torchrun
// runs the same GoogleTest cases in the same order, so the collectives inside them match up. A test
// must issue the same collectives on every rank whatever its assertions find: checks use EXPECT_*,
// and ASSERT_* only before the first collective or after the last.
#pragma once

#include "mixprec/distributed/communicator.h"
#include "mixprec/distributed/init.h"
#include "mixprec/precision/convert.h"
#include "mixprec/precision/keep_fp32.h"

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>

#include <chrono>
#include <memory>
#include <string>

namespace mixprec::testing {

// The group every test shares (formed once from torchrun's environment in mp_main.cpp).
distributed::Communicator& world();
std::shared_ptr<distributed::Communicator> world_ptr();
void set_world(std::shared_ptr<distributed::Communicator> comm);  // once, from mp_main.cpp
// Where the tests' models and batches live: the group's GPU when it runs on NCCL
// (MIXPREC_TEST_BACKEND=nccl, scripts/gpu-check.sh), else the CPU.
c10::Device test_device();
// A client of torchrun's agent store under its own key prefix, for tests that form groups of
// their own.
c10::intrusive_ptr<c10d::Store> test_store(
    const std::string& prefix, std::chrono::milliseconds timeout = std::chrono::seconds(10));
// A group of the whole world of its own, under store prefix `name`, whose collectives time out
// after `timeout`: for tests that fail or time out a group, which then stays unusable.
std::shared_ptr<distributed::Communicator> own_group(const std::string& name,
                                                     std::chrono::milliseconds timeout);

// Bitwise (wherever each tensor lives), or with `bitwise` false within what two processors'
// different rounding leaves after a few steps: 1e-5 relative in FP32, 2e-2 in a half dtype
// (a few BF16 units in the last place). The offloaded optimizer steps on the host; with the
// models on a GPU, comparisons against a run that steps there use the second form.
bool equal_or_close(const at::Tensor& a, const at::Tensor& b, bool bitwise);

// True on every rank iff `t` has the same dtype, shape and bytes on every rank (collective).
bool same_on_all_ranks(const at::Tensor& t);

// A small model with every kind of parameter, odd sizes throughout (in model order):
//   fc1.weight 16x13, fc1.bias 16   half      gate 16                     FP32 (kept)
//   fc2.weight 7x16, fc2.bias 7     half      frozen.weight 7x7, .bias 7  half, frozen
//   head.weight 5x7, head.bias 5    half      scale 5                     FP32 (kept)
// `half` is BFloat16 or Half. Built from a fixed seed: identical on every rank and call; on
// test_device().
struct MixedNetImpl : torch::nn::Module {
  explicit MixedNetImpl(at::ScalarType half = at::kBFloat16, uint64_t seed = 1234);
  at::Tensor loss(const at::Tensor& x);
  at::ScalarType half;
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, frozen{nullptr}, head{nullptr};
  at::Tensor gate, scale;
};
TORCH_MODULE(MixedNet);

// A batch for step `step`: the same on every rank unless `rank` >= 0 (then rank-dependent);
// on test_device().
at::Tensor batch(int64_t step, int rank = -1);

// `values` of a parameter's pieces gathered from every rank: piece r of `fqn` is what rank r
// owns (as given by `begin`/`end` per rank). `local` holds this rank's piece values in
// [begin, end) of a numel-long FP32 vector (other entries are ignored). Collective.
at::Tensor gather_pieces(const at::Tensor& local, int64_t begin, int64_t end);

}  // namespace mixprec::testing
