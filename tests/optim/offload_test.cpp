// Float16Optimizer with offloading (optim/offload.h) against the same optimizer without it:
// bitwise parameters, masters and moments after every step, for chunk sizes that split
// parameters (and chunks that hold everything), one to three chunks in flight, every
// algorithm, with and without master remainders, with a dynamic loss scaler (an overflow
// step), clipping, parameters without gradients, frozen ones. On this CPU-only machine the
// "device" is the CPU and the chunked copies run through staging buffers and the copy thread;
// the Cuda* cases run where CUDA is available and skip otherwise.
#include "mixprec/optim/offload.h"

#include "mixprec/optim/float16_optimizer.h"
#include "optim/support_mixed.h"
#include "support/error_message.h"

#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <limits>

namespace mixprec::optim {
namespace MIXPREC_UNITY_ID {  // anonymous outside unity builds (tests/CMakeLists.txt)

using mixprec::testing::AlgoCase;
using mixprec::testing::error_of;
using mixprec::testing::expect_same_optimizer_state;
using mixprec::testing::expect_same_params;
using mixprec::testing::make_mixed_optimizer;
using mixprec::testing::Mixed;
using mixprec::testing::same_bits_any;
using mixprec::testing::set_mixed_grads;

// The training-loop options every case uses: an FP16-style dynamic scaler and clipping.
Float16OptimizerOptions mixed_options(bool remainders) {
  LossScalerOptions scaler = LossScalerOptions::fp16_dynamic();
  scaler.initial_scale(1024.0);
  scaler.growth_interval(3);
  return Float16OptimizerOptions().loss_scaler(scaler).clip_grad(0.5).master_remainders(remainders);
}

// Gradients for `step`, scaled by the optimizer's loss scale; step 4 overflows in "h".
void step_grads(Mixed& model, const Float16Optimizer& opt, int64_t step) {
  const std::vector<std::string> skip =
      step % 4 == 1 ? std::vector<std::string>{"a"} : std::vector<std::string>{};
  set_mixed_grads(*model, step, opt.loss_scale(), skip);
  if (step == 4) {
    model->param("h").mutable_grad()[3] = std::numeric_limits<float>::infinity();
  }
}

struct PipelineCase {
  int64_t chunk_bytes;
  int64_t in_flight;
  bool remainders;
  std::string algo;
};

AlgoCase algo_named(const std::string& name) {
  for (const AlgoCase& a : mixprec::testing::algo_cases()) {
    if (a.name == name) return a;
  }
  throw std::runtime_error("no algorithm " + name);
}

class OffloadPipelines : public ::testing::TestWithParam<PipelineCase> {};

TEST_P(OffloadPipelines, BitwiseEqualToTheStepWithoutOffloading) {
  const PipelineCase c = GetParam();
  const AlgoCase algo = algo_named(c.algo);
  Mixed plain_model, offloaded_model;
  auto plain = make_mixed_optimizer(*plain_model, algo, mixed_options(c.remainders));
  auto offloaded = make_mixed_optimizer(
      *offloaded_model, algo,
      mixed_options(c.remainders)
          .offload(OffloadOptions().chunk_bytes(c.chunk_bytes).chunks_in_flight(c.in_flight)));
  for (int64_t step = 0; step < 9; ++step) {
    step_grads(plain_model, *plain, step);
    step_grads(offloaded_model, *offloaded, step);
    const StepResult p = plain->update(), o = offloaded->update();
    const std::string where = "step " + std::to_string(step);
    EXPECT_EQ(p.success, o.success) << where;
    EXPECT_EQ(p.success, step != 4) << where;
    EXPECT_EQ(p.grad_norm, o.grad_norm) << where;
    EXPECT_EQ(p.params_stepped, o.params_stepped) << where;
    expect_same_params(*plain_model, *offloaded_model, where);
    expect_same_optimizer_state(*plain, *offloaded, where);
  }
}

std::vector<PipelineCase> pipeline_cases() {
  std::vector<PipelineCase> out;
  for (const char* algo : {"AdamWAmsgrad", "SgdDampenedDecay"}) {
    for (bool remainders : {false, true}) {
      out.push_back({256, 1, remainders, algo});      // every parameter split, no overlap
      out.push_back({256, 2, remainders, algo});      // every parameter split, overlapped
      out.push_back({1000, 3, remainders, algo});     // odd-sized chunks, three in flight
      out.push_back({40000, 2, remainders, algo});    // "big" split once or twice
      out.push_back({1 << 20, 2, remainders, algo});  // one chunk holds everything
    }
  }
  for (const char* algo : {"AdamW", "AdamL2", "SgdNesterov", "SgdPlain"}) {
    out.push_back({4096, 2, true, algo});
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Cases, OffloadPipelines, ::testing::ValuesIn(pipeline_cases()),
                         [](const auto& info) {
                           const PipelineCase& c = info.param;
                           return c.algo + "_Chunk" + std::to_string(c.chunk_bytes) + "_InFlight" +
                                  std::to_string(c.in_flight) + (c.remainders ? "_Remainders" : "");
                         });

// What one step copies: gradients down, parameters up, and down too where the step reads
// them (native FP32; BF16 with a remainder), in as many chunks as the staging size makes.
TEST(Offload, StatsCountTheChunksAndTheBytesCopied) {
  for (bool remainders : {false, true}) {
    Mixed model;
    auto opt = make_mixed_optimizer(*model, mixprec::testing::algo_cases()[0],
                                    Float16OptimizerOptions()
                                        .master_remainders(remainders)
                                        .offload(OffloadOptions().chunk_bytes(4096)));
    set_mixed_grads(*model, 0);
    ASSERT_TRUE(opt->update().success);
    int64_t down = 0, up = 0;
    for (const auto& p : model->parameters()) {
      if (!p.requires_grad()) continue;
      const int64_t bytes = static_cast<int64_t>(p.nbytes());
      down += bytes;  // the gradient, in the parameter's dtype here
      up += bytes;
      if (p.scalar_type() == at::kFloat || (remainders && p.scalar_type() == at::kBFloat16)) {
        down += bytes;
      }
    }
    const OffloadStats& stats = opt->offload_stats();
    EXPECT_EQ(stats.bytes_down, down) << remainders;
    EXPECT_EQ(stats.bytes_up, up) << remainders;
    // A chunk stages at most 4096 bytes of gradients and parameters (`up` bytes of each).
    EXPECT_GE(stats.chunks, 2 * up / 4096);
    EXPECT_GE(stats.hidden_copy_seconds(), 0.0);
    EXPECT_LE(stats.hidden_copy_seconds(), stats.copy_seconds);
  }
}

TEST(Offload, NothingCopiedWithoutOffloading) {
  Mixed model;
  auto opt = make_mixed_optimizer(*model, mixprec::testing::algo_cases()[0]);
  set_mixed_grads(*model, 0);
  ASSERT_TRUE(opt->update().success);
  EXPECT_EQ(opt->offload_stats().chunks, 0);
  EXPECT_EQ(opt->offload_stats().bytes_up, 0);
}

// Parameters written by the copies have their version counters bumped, as an in-place write
// would: a model state dict built before the step is seen to be stale by checkpoint savers.
TEST(Offload, StepBumpsTheVersionOfEveryParameterItWrites) {
  Mixed model;
  auto opt =
      make_mixed_optimizer(*model, mixprec::testing::algo_cases()[0],
                           Float16OptimizerOptions().offload(OffloadOptions().chunk_bytes(512)));
  const ShardedStateDict before = model_sharded_state_dict(*model);
  set_mixed_grads(*model, 0, 1.0, {"w"});
  ASSERT_TRUE(opt->update().success);
  for (const auto& [fqn, t] : before.tensors) {
    const bool stepped = fqn != "w" && fqn != "z";
    EXPECT_EQ(t.local._version() != t.version, stepped) << fqn;
  }
}

// A step that fails before it writes any parameter (here the host cannot allocate the staging
// memory) leaves the optimizer as it was: its parameters must not look written from outside,
// which would re-seed every master from its BF16 parameter (with remainders, dropping their
// low halves).
TEST(Offload, AStepThatFailsBeforeItWritesLeavesTheMastersAsTheyWere) {
  const AlgoCase algo = mixprec::testing::algo_cases()[0];
  for (const bool remainders : {false, true}) {
    SCOPED_TRACE(remainders ? "remainders" : "fp32 masters");
    Mixed trained_model, model;
    auto trained = make_mixed_optimizer(*trained_model, algo,
                                        Float16OptimizerOptions().master_remainders(remainders));
    for (int64_t step = 0; step < 3; ++step) {
      set_mixed_grads(*trained_model, step);
      ASSERT_TRUE(trained->update().success);
    }
    {
      at::NoGradGuard no_grad;
      for (const auto& item : trained_model->named_parameters())
        model->param(item.key()).copy_(item.value());
    }
    auto failing = make_mixed_optimizer(
        *model, algo,
        Float16OptimizerOptions()
            .master_remainders(remainders)
            .offload(OffloadOptions().chunk_bytes(int64_t{1} << 50)));  // no host stages a petabyte
    failing->load_state_dict(trained->state_dict());
    set_mixed_grads(*model, 3);
    EXPECT_THROW(failing->update(), c10::Error);
    expect_same_optimizer_state(*trained, *failing, "after the failed step");
    expect_same_params(*trained_model, *model, "after the failed step");
  }
}

TEST(Offload, OutsideWriteReseedsTheHostMasterAsWithoutOffloading) {
  const AlgoCase algo = mixprec::testing::algo_cases()[0];
  Mixed plain_model, offloaded_model;
  auto plain = make_mixed_optimizer(*plain_model, algo);
  auto offloaded = make_mixed_optimizer(*offloaded_model, algo,
                                        Float16OptimizerOptions().offload(OffloadOptions()));
  const at::Tensor written = (at::randn({3, 7}) * 2).to(at::kBFloat16);
  for (int64_t step = 0; step < 6; ++step) {
    if (step == 3) {
      at::NoGradGuard no_grad;
      plain_model->param("w").copy_(written);
      offloaded_model->param("w").copy_(written);
      plain_model->param("f").mul_(2);  // native FP32: stepped from its value on the device
      offloaded_model->param("f").mul_(2);
    }
    set_mixed_grads(*plain_model, step);
    set_mixed_grads(*offloaded_model, step);
    ASSERT_TRUE(plain->update().success);
    ASSERT_TRUE(offloaded->update().success);
    expect_same_params(*plain_model, *offloaded_model, "step " + std::to_string(step));
    expect_same_optimizer_state(*plain, *offloaded, "step " + std::to_string(step));
  }
}

// Frozen parameters and parameters without state round-trip through both state-dict forms,
// from an offloaded optimizer into a plain one and back (the seed's HybridDeviceOptimizer
// fix: a parameter without an FP32 main copy must not break either form).
struct RoundTrip {
  bool from_offloaded, positional;
};
class OffloadStateDicts : public ::testing::TestWithParam<RoundTrip> {};

TEST_P(OffloadStateDicts, RoundTripAcrossOffloadingContinuesBitwise) {
  const RoundTrip r = GetParam();
  const AlgoCase algo = mixprec::testing::algo_cases()[1];
  auto opts = [](bool offload) {
    Float16OptimizerOptions o;
    if (offload) o.offload(OffloadOptions().chunk_bytes(300).chunks_in_flight(2));
    return o;
  };
  Mixed saved_model;
  auto saved = make_mixed_optimizer(*saved_model, algo, opts(r.from_offloaded));
  for (int64_t step = 0; step < 4; ++step) {
    set_mixed_grads(*saved_model, step, 1.0, {"w", "f"});  // no state for "w" nor "f"
    ASSERT_TRUE(saved->update().success);
  }
  const ShardedStateDict sharded = saved->sharded_state_dict();
  const auto& common = sharded.common["optimizer"];
  EXPECT_EQ(common["frozen"], nlohmann::json({"z"}));
  EXPECT_EQ(common["without_state"], nlohmann::json({"f", "w"}));
  EXPECT_FALSE(sharded.contains("optimizer.state.fp32_param.f"));  // native FP32: no copy
  EXPECT_TRUE(sharded.contains("optimizer.state.fp32_param.w"));   // a master, no moments
  EXPECT_FALSE(sharded.contains("optimizer.state.exp_avg.w"));

  Mixed loaded_model(/*seed=*/42);
  auto loaded = make_mixed_optimizer(*loaded_model, algo, opts(!r.from_offloaded));
  load_model_sharded_state_dict(*loaded_model, model_sharded_state_dict(*saved_model).clone());
  const LoadReport report = r.positional ? loaded->load_state_dict(saved->state_dict())
                                         : loaded->load_sharded_state_dict(sharded.clone());
  EXPECT_TRUE(report.clean()) << report.to_string();
  for (int64_t step = 4; step < 9; ++step) {
    set_mixed_grads(*saved_model, step);
    set_mixed_grads(*loaded_model, step);
    ASSERT_TRUE(saved->update().success);
    ASSERT_TRUE(loaded->update().success);
    expect_same_params(*saved_model, *loaded_model, "step " + std::to_string(step));
    expect_same_optimizer_state(*saved, *loaded, "step " + std::to_string(step));
  }
}

INSTANTIATE_TEST_SUITE_P(Forms, OffloadStateDicts,
                         ::testing::Values(RoundTrip{true, false}, RoundTrip{false, false},
                                           RoundTrip{true, true}, RoundTrip{false, true}),
                         [](const auto& info) {
                           return std::string(info.param.from_offloaded ? "OffloadedToPlain"
                                                                        : "PlainToOffloaded") +
                                  (info.param.positional ? "Positional" : "Sharded");
                         });

TEST(Offload, BadOptionsAreRefusedNamingTheOption) {
  Mixed model;
  const AlgoCase algo = mixprec::testing::algo_cases()[0];
  std::string msg = error_of([&] {
    make_mixed_optimizer(*model, algo,
                         Float16OptimizerOptions().offload(OffloadOptions().chunk_bytes(100)));
  });
  EXPECT_NE(msg.find("[mixprec::Float16Optimizer] OffloadOptions::chunk_bytes must be at least "
                     "256, got 100"),
            std::string::npos)
      << msg;
  msg = error_of([&] {
    make_mixed_optimizer(*model, algo,
                         Float16OptimizerOptions().offload(OffloadOptions().chunks_in_flight(0)));
  });
  EXPECT_NE(msg.find("OffloadOptions::chunks_in_flight must be at least 1, got 0"),
            std::string::npos)
      << msg;
}

// --- CUDA (scripts/gpu-check.sh runs these on a GPU machine) ---------------------------------

// Parameters and gradients on the GPU, state on the host, stepped by the CPU kernels: bitwise
// the plain optimizer on a CPU copy of the model (no clipping: the gradient norm is summed on
// the device, in another order than on the host).
TEST(OffloadCuda, GpuParamsStepBitwiseAsThePlainCpuOptimizer) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device in this build or machine";
  for (bool remainders : {false, true}) {
    for (int64_t in_flight : {1, 3}) {
      SCOPED_TRACE(std::string(remainders ? "remainders " : "") + "in flight " +
                   std::to_string(in_flight));
      const AlgoCase algo = mixprec::testing::algo_cases()[1];
      Mixed cpu_model, gpu_model;
      gpu_model->to(at::Device(at::kCUDA, 0));
      auto options = [&] {
        LossScalerOptions scaler = LossScalerOptions::fp16_dynamic();
        scaler.initial_scale(1024.0);
        return Float16OptimizerOptions().loss_scaler(scaler).master_remainders(remainders);
      };
      auto plain = make_mixed_optimizer(*cpu_model, algo, options());
      auto offloaded = make_mixed_optimizer(
          *gpu_model, algo,
          options().offload(OffloadOptions().chunk_bytes(4096).chunks_in_flight(in_flight)));
      for (int64_t step = 0; step < 6; ++step) {
        step_grads(cpu_model, *plain, step);
        for (const auto& item : cpu_model->named_parameters()) {
          const at::Tensor& g = item.value().grad();
          gpu_model->param(item.key()).mutable_grad() =
              g.defined() ? g.to(at::Device(at::kCUDA, 0)) : at::Tensor();
        }
        const StepResult p = plain->update(), o = offloaded->update();
        EXPECT_EQ(p.success, o.success);
        expect_same_params(*cpu_model, *gpu_model, "step " + std::to_string(step));
        expect_same_optimizer_state(*plain, *offloaded, "step " + std::to_string(step));
      }
      EXPECT_GT(offloaded->offload_stats().chunks, 1);
    }
  }
}

}  // namespace MIXPREC_UNITY_ID
}  // namespace mixprec::optim
