// Lossless master remainders, the fused steps (optim/master_remainder.h) against the
// FP32-master path of the same library: fused_adam_step / fused_sgd_step with an FP32 master
// and a BF16 model param, itself checked bit for bit against LibTorch's fused kernels in
// fused_kernels_test.cpp. BITWISE after every step: masters (joined), moments and momentum
// buffers; the BF16 param equals the FP32 path's model param except at exact even ties, where
// it is one more in the bits (the format's rounding, master_remainder_test.cpp).
#include "mixprec/optim/master_remainder.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "mixprec/optim/fused_kernels.h"
#include "optim/support_kernels.h"

// White-box hooks (SIMD target selection) from the private headers.
#include "../../src/optim/kernels/kernel_args.h"

namespace mixprec::optim {
namespace MIXPREC_UNITY_ID {  // anonymous outside unity builds (tests/CMakeLists.txt)

using mixprec::testing::bumped_by;
using mixprec::testing::expect_rejected;
using mixprec::testing::same_bits;

// ---------------------------------------------------------------- the fused steps

// Masters that exercise the rounding: random values of both signs, exact BF16 ties with even
// and odd neighbours, patterns a few FP32 ulps either side of a tie, tiny and large values.
at::Tensor test_masters(int64_t n, uint64_t seed) {
  at::manual_seed(seed);
  const at::Tensor random = at::randn({n}) * 2.0;
  // A BF16 value in ±[0.25, 4), then the tie above it moved by -3..3 FP32 ulps.
  const at::Tensor base = (at::rand({n}) * 3.75 + 0.25) * (at::randint(0, 2, {n}) * 2 - 1);
  const at::Tensor high = base.to(at::kBFloat16).to(at::kFloat).view(at::kInt);
  const at::Tensor near_tie = (high + 0x8000 + at::randint(-3, 4, {n}, at::kInt)).view(at::kFloat);
  const at::Tensor tiny = at::randn({n}) * 1e-30;
  const at::Tensor kind = at::randint(0, 8, {n});
  return at::where(kind < 3, random, at::where(kind < 7, near_tie, tiny));
}

// The BF16 param split_master derives from `master`: RNE (the FP32 path's model param) plus
// one at exact even ties.
at::Tensor expected_param(const at::Tensor& master, const at::Tensor& rne_model) {
  const at::Tensor even_tie = master.view(at::kInt).bitwise_and(0x1FFFF) == 0x8000;
  const at::Tensor bits = rne_model.view(at::kShort);
  return at::where(even_tie, bits + 1, bits).to(at::kShort).view(at::kBFloat16);
}

int64_t even_ties(const at::Tensor& master) {
  return (master.view(at::kInt).bitwise_and(0x1FFFF) == 0x8000).sum().item<int64_t>();
}

struct AdamCase {
  const char* name;
  AdamHyperParams hp;
  at::ScalarType grad_dtype;
  double grad_scale;  // gradients are fed multiplied by this, with grad_scale_inv = 1 / it
};

std::vector<AdamCase> adam_cases() {
  auto hp = [](double lr, double wd, bool decoupled, bool amsgrad, bool maximize,
               double beta1 = 0.9) {
    AdamHyperParams h;
    h.lr = lr;
    h.beta1 = beta1;
    h.weight_decay = wd;
    h.decoupled_weight_decay = decoupled;
    h.amsgrad = amsgrad;
    h.maximize = maximize;
    return h;
  };
  return {{"AdamW", hp(1e-3, 0.01, true, false, false), at::kBFloat16, 1.0},
          {"AdamL2", hp(1e-3, 0.1, false, false, false), at::kFloat, 1.0},
          {"AdamWAmsgradScaledF16", hp(1e-3, 0.05, true, true, false), at::kHalf, 512.0},
          {"AdamL2AmsgradMaximizeScaled", hp(1e-3, 0.02, false, true, true), at::kBFloat16, 3.0},
          // Steps of about one FP32 ulp walk the near-tie masters across their ties.
          {"AdamWTinyLrAcrossTies", hp(1e-7, 0.01, true, false, false, 0.5), at::kBFloat16, 1.0}};
}

struct Fp32MasterState {
  at::Tensor master, model, exp_avg, exp_avg_sq, max_exp_avg_sq;
};
struct HeldMasterState {
  at::Tensor param, remainder, exp_avg, exp_avg_sq, max_exp_avg_sq;
};

class RemainderAdam : public ::testing::TestWithParam<std::tuple<int64_t, int>> {};

TEST_P(RemainderAdam, BitwiseEqualToFp32MasterPathOverSteps) {
  constexpr int64_t kSteps = 25;
  const auto [n, which] = GetParam();
  const AdamCase c = adam_cases()[which];
  const at::Tensor start = test_masters(n, 100 + which);
  auto zeros = [n = n] { return at::zeros({n}); };
  Fp32MasterState ref{start.clone(), start.to(at::kBFloat16), zeros(), zeros(),
                      c.hp.amsgrad ? zeros() : at::Tensor()};
  const MasterSplit split = split_master(start);
  HeldMasterState ours{split.param, split.remainder, zeros(), zeros(),
                       c.hp.amsgrad ? zeros() : at::Tensor()};
  int64_t ties = 0;
  for (int64_t step = 1; step <= kSteps; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    const at::Tensor grad = (at::randn({n}) * c.grad_scale).to(c.grad_dtype);
    const double inv = 1.0 / c.grad_scale;
    fused_adam_step(ref.master, grad, ref.exp_avg, ref.exp_avg_sq, ref.max_exp_avg_sq, ref.model,
                    step, c.hp, inv);
    fused_adam_step_remainder(ours.param, ours.remainder, grad, ours.exp_avg, ours.exp_avg_sq,
                              ours.max_exp_avg_sq, step, c.hp, inv);
    ASSERT_TRUE(same_bits(join_master(ours.param, ours.remainder), ref.master));
    ASSERT_TRUE(same_bits(ours.exp_avg, ref.exp_avg));
    ASSERT_TRUE(same_bits(ours.exp_avg_sq, ref.exp_avg_sq));
    if (c.hp.amsgrad) ASSERT_TRUE(same_bits(ours.max_exp_avg_sq, ref.max_exp_avg_sq));
    ASSERT_TRUE(same_bits(ours.param, expected_param(ref.master, ref.model)));
    ties += even_ties(ref.master);
  }
  // The walk across ties must have produced exact ties to check (and they are rare otherwise).
  if (std::string(c.name) == "AdamWTinyLrAcrossTies" && n >= 1023) EXPECT_GT(ties, 0);
}

INSTANTIATE_TEST_SUITE_P(Sizes, RemainderAdam,
                         ::testing::Combine(::testing::Values(1, 7, 8, 9, 1023, 1025, 100003),
                                            ::testing::Range(0, 5)),
                         [](const auto& info) {
                           return adam_cases()[std::get<1>(info.param)].name + std::string("_") +
                                  std::to_string(std::get<0>(info.param));
                         });

TEST(RemainderAdam, ExactTiesRoundAwayFromZeroAndStayExact) {
  // lr = 0: the masters do not move. Ties of both signs above even and odd BF16 values: the
  // even half differ from RNE.
  std::vector<int32_t> bits;
  for (int32_t high : {0x3F80, 0x3F81, 0x4000, 0x4001, 0x0080, 0x0081}) {
    for (int32_t sign : {0, 1}) bits.push_back(sign << 31 | high << 16 | 0x8000);
  }
  const int64_t n = static_cast<int64_t>(bits.size());
  const at::Tensor master = at::from_blob(bits.data(), {n}, at::kInt).view(at::kFloat).clone();
  AdamHyperParams hp;
  hp.lr = 0.0;
  hp.weight_decay = 0.1;
  MasterSplit s = split_master(master);
  const at::Tensor m = at::zeros({n}), v = at::zeros({n});
  fused_adam_step_remainder(s.param, s.remainder, at::randn({n}), m, v, {}, 1, hp);
  EXPECT_TRUE(same_bits(join_master(s.param, s.remainder), master));
  const at::Tensor rne = master.to(at::kBFloat16);
  EXPECT_TRUE(same_bits(s.param, expected_param(master, rne)));
  EXPECT_EQ((s.param.view(at::kShort) != rne.view(at::kShort)).sum().item<int64_t>(), n / 2);
}

// Sets LibTorch's thread count for one scope.
struct NumThreadsGuard {
  explicit NumThreadsGuard(int n) : previous(at::get_num_threads()) { at::set_num_threads(n); }
  ~NumThreadsGuard() { at::set_num_threads(previous); }
  int previous;
};

TEST(RemainderAdam, ThreadCountDoesNotChangeResults) {
  const int64_t n = 9 * 32 * 1024 + 5;  // several work chunks and a partial vector
  const at::Tensor start = test_masters(n, 7);
  AdamHyperParams hp;
  hp.weight_decay = 0.01;
  hp.amsgrad = true;
  std::vector<HeldMasterState> runs;
  for (const int threads : {1, 4}) {
    NumThreadsGuard guard(threads);
    at::manual_seed(8);
    const MasterSplit s = split_master(start);
    HeldMasterState st{s.param, s.remainder, at::zeros({n}), at::zeros({n}), at::zeros({n})};
    for (int64_t step = 1; step <= 5; ++step) {
      const at::Tensor grad = at::randn({n}).to(at::kBFloat16);
      fused_adam_step_remainder(st.param, st.remainder, grad, st.exp_avg, st.exp_avg_sq,
                                st.max_exp_avg_sq, step, hp);
    }
    runs.push_back(st);
  }
  EXPECT_TRUE(same_bits(runs[0].param, runs[1].param));
  EXPECT_TRUE(same_bits(runs[0].remainder, runs[1].remainder));
  EXPECT_TRUE(same_bits(runs[0].exp_avg, runs[1].exp_avg));
  EXPECT_TRUE(same_bits(runs[0].exp_avg_sq, runs[1].exp_avg_sq));
  EXPECT_TRUE(same_bits(runs[0].max_exp_avg_sq, runs[1].max_exp_avg_sq));
}

// ---------------------------------------------------------------- SGD

class RemainderSgd : public ::testing::TestWithParam<std::tuple<int64_t, int>> {};

std::vector<std::pair<const char*, SgdHyperParams>> sgd_cases() {
  auto hp = [](double momentum, double dampening, bool nesterov, double wd, bool maximize) {
    SgdHyperParams h;
    h.lr = 1e-3;
    h.momentum = momentum;
    h.dampening = dampening;
    h.nesterov = nesterov;
    h.weight_decay = wd;
    h.maximize = maximize;
    return h;
  };
  return {{"Plain", hp(0, 0, false, 0, false)},
          {"MomentumDampeningDecay", hp(0.9, 0.1, false, 0.01, false)},
          {"NesterovMaximize", hp(0.8, 0, true, 0.01, true)}};
}

TEST_P(RemainderSgd, BitwiseEqualToFp32MasterPathOverSteps) {
  constexpr int64_t kSteps = 20;
  const auto [n, which] = GetParam();
  const SgdHyperParams hp = sgd_cases()[which].second;
  const bool momentum = hp.momentum != 0.0;
  const at::Tensor start = test_masters(n, 200 + which);
  at::Tensor master = start.clone(), model = start.to(at::kBFloat16);
  at::Tensor ref_buf = momentum ? at::empty({n}) : at::Tensor();
  at::Tensor buf = momentum ? at::empty({n}) : at::Tensor();
  MasterSplit ours = split_master(start);
  for (int64_t step = 1; step <= kSteps; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    const at::Tensor grad = (at::randn({n}) * 1024.0).to(at::kBFloat16);
    fused_sgd_step(master, grad, ref_buf, model, step == 1, hp, 1.0 / 1024.0);
    fused_sgd_step_remainder(ours.param, ours.remainder, grad, buf, step == 1, hp, 1.0 / 1024.0);
    ASSERT_TRUE(same_bits(join_master(ours.param, ours.remainder), master));
    if (momentum) ASSERT_TRUE(same_bits(buf, ref_buf));
    ASSERT_TRUE(same_bits(ours.param, expected_param(master, model)));
  }
}

INSTANTIATE_TEST_SUITE_P(Sizes, RemainderSgd,
                         ::testing::Combine(::testing::Values(1, 9, 1025, 100003),
                                            ::testing::Range(0, 3)),
                         [](const auto& info) {
                           return sgd_cases()[std::get<1>(info.param)].first + std::string("_") +
                                  std::to_string(std::get<0>(info.param));
                         });

// ---------------------------------------------------------------- argument checks

// All arguments of one fused_adam_step_remainder call, valid until a test breaks one of them.
struct RemainderAdamCall {
  int64_t n = 33;
  at::Tensor param = at::randn({n}).to(at::kBFloat16),
             remainder = at::randint(-9, 9, {n}, at::kShort);
  at::Tensor grad = at::randn({n}).to(at::kBFloat16);
  at::Tensor exp_avg = at::rand({n}), exp_avg_sq = at::rand({n}), max_sq = at::rand({n});
  int64_t step = 3;
  AdamHyperParams hp = [] {
    AdamHyperParams h;
    h.amsgrad = true;
    return h;
  }();
  double inv = 1.0;
  void run() const {
    fused_adam_step_remainder(param, remainder, grad, exp_avg, exp_avg_sq, max_sq, step, hp, inv);
  }
  std::vector<at::Tensor> all() const {
    return {param, remainder, grad, exp_avg, exp_avg_sq, max_sq};
  }
};

TEST(RemainderErrors, EachBadArgumentIsNamedAndNothingIsWritten) {
  const std::vector<std::pair<std::string, std::function<void(RemainderAdamCall&)>>> cases = {
      {"param is undefined", [](RemainderAdamCall& c) { c.param = at::Tensor(); }},
      {"param must be bfloat16", [](RemainderAdamCall& c) { c.param = c.param.to(at::kHalf); }},
      {"remainder must be int16",
       [](RemainderAdamCall& c) { c.remainder = c.remainder.to(at::kInt); }},
      {"remainder has 32 elements",
       [](RemainderAdamCall& c) { c.remainder = c.remainder.slice(0, 1); }},
      {"remainder must be contiguous",
       [](RemainderAdamCall& c) {
         c.remainder = at::zeros({c.n, 2}, at::kShort).select(1, 0);
       }},
      {"param and remainder share memory",
       [](RemainderAdamCall& c) { c.remainder = c.param.view(at::kShort); }},
      {"grad must be float32, bfloat16 or float16",
       [](RemainderAdamCall& c) { c.grad = c.grad.to(at::kInt); }},
      {"exp_avg must be float32",
       [](RemainderAdamCall& c) { c.exp_avg = c.exp_avg.to(at::kHalf); }},
      {"max_exp_avg_sq must be defined exactly when hp.amsgrad",
       [](RemainderAdamCall& c) { c.hp.amsgrad = false; }},
      {"exp_avg and exp_avg_sq share memory",
       [](RemainderAdamCall& c) { c.exp_avg_sq = c.exp_avg; }},
      {"step counts this update", [](RemainderAdamCall& c) { c.step = 0; }},
      {"invalid hp.beta2", [](RemainderAdamCall& c) { c.hp.beta2 = 1.0; }},
      {"grad_scale_inv must be finite", [](RemainderAdamCall& c) { c.inv = INFINITY; }},
  };
  for (const auto& [message, breaker] : cases) {
    SCOPED_TRACE(message);
    RemainderAdamCall call;
    breaker(call);
    expect_rejected([&] { call.run(); }, call.all(), "fused_adam_step_remainder", message);
  }
}

TEST(RemainderErrors, SgdMomentumBuffer) {
  const int64_t n = 9;
  const at::Tensor param = at::randn({n}).to(at::kBFloat16), rem = at::zeros({n}, at::kShort);
  const at::Tensor grad = at::randn({n}), buf = at::randn({n});
  SgdHyperParams momentum;
  momentum.momentum = 0.9;
  expect_rejected([&] { fused_sgd_step_remainder(param, rem, grad, {}, false, momentum); },
                  {param, rem}, "fused_sgd_step_remainder", "momentum_buffer must be defined");
  expect_rejected(
      [&] { fused_sgd_step_remainder(param, rem, grad, buf.to(at::kHalf), false, momentum); },
      {param, rem}, "fused_sgd_step_remainder", "momentum_buffer must be float32");
  expect_rejected([&] { fused_sgd_step_remainder(param, rem, grad, rem, false, momentum); },
                  {param, rem}, "fused_sgd_step_remainder", "momentum_buffer must be float32");
}

// Every tensor a CPU kernel writes has its version counter bumped, as an in-place ATen op's
// would be; what it only reads keeps its version (bumped_by: support_kernels.h).
TEST(RemainderKernels, CpuKernelsBumpTheVersionOfWhatTheyWriteOnly) {
  const RemainderAdamCall adam;
  EXPECT_EQ(bumped_by([&] { adam.run(); }, adam.all()),
            (std::vector<bool>{true, true, false, true, true, true}));
  const int64_t n = 33;
  const at::Tensor master = at::randn({n});
  const at::Tensor param = at::empty({n}, at::kBFloat16), rem = at::empty({n}, at::kShort);
  EXPECT_EQ(bumped_by([&] { split_master_out(master, param, rem); }, {master, param, rem}),
            (std::vector<bool>{false, true, true}));
  const at::Tensor out = at::empty({n});
  EXPECT_EQ(bumped_by([&] { join_master_out(param, rem, out); }, {param, rem, out}),
            (std::vector<bool>{false, false, true}));
  const at::Tensor grad = at::randn({n}), buf = at::zeros({n});
  SgdHyperParams sgd;
  sgd.momentum = 0.9;
  EXPECT_EQ(bumped_by([&] { fused_sgd_step_remainder(param, rem, grad, buf, true, sgd); },
                      {param, rem, buf, grad}),
            (std::vector<bool>{true, true, true, false}));
}

// ---------------------------------------------------------------- SIMD targets, other devices

TEST(RemainderSimdTargets, EveryTargetSplitsJoinsAndStepsAlike) {
  const std::vector<std::string> targets = detail::supported_simd_targets();
  ASSERT_FALSE(targets.empty());
  at::manual_seed(41);
  const at::Tensor patterns =
      at::randint(INT32_MIN, INT32_MAX, {1 << 16}, at::kInt).view(at::kFloat);
  const MasterSplit best = split_master(patterns);
  const int64_t n = 10007;
  const at::Tensor start = test_masters(n, 42), grad = at::randn({n}).to(at::kBFloat16);
  AdamHyperParams hp;
  hp.weight_decay = 0.01;
  hp.amsgrad = true;
  struct RestoreAutomaticTarget {
    ~RestoreAutomaticTarget() { detail::force_simd_target(""); }
  } restore;
  for (const auto& name : targets) {
    SCOPED_TRACE(name);
    detail::force_simd_target(name);
    const MasterSplit s = split_master(patterns);
    EXPECT_TRUE(same_bits(s.param, best.param));
    EXPECT_TRUE(same_bits(s.remainder, best.remainder));
    const at::Tensor quieted = patterns.view(at::kInt).bitwise_or(
        at::where(patterns.isnan(), at::full({}, 0x00400000, at::kInt), at::zeros({}, at::kInt)));
    EXPECT_TRUE(same_bits(join_master(s.param, s.remainder).view(at::kInt), quieted));
    // On one target both paths run the same operations (FMA or not): bitwise equal.
    at::Tensor master = start.clone(), model = start.to(at::kBFloat16);
    at::Tensor m1 = at::zeros({n}), v1 = at::zeros({n}), x1 = at::zeros({n});
    at::Tensor m2 = at::zeros({n}), v2 = at::zeros({n}), x2 = at::zeros({n});
    const MasterSplit held = split_master(start);
    for (int64_t step = 1; step <= 3; ++step) {
      fused_adam_step(master, grad, m1, v1, x1, model, step, hp);
      fused_adam_step_remainder(held.param, held.remainder, grad, m2, v2, x2, step, hp);
    }
    EXPECT_TRUE(same_bits(join_master(held.param, held.remainder), master));
    EXPECT_TRUE(same_bits(held.param, expected_param(master, model)));
    EXPECT_TRUE(same_bits(v1, v2));
  }
}

TEST(RemainderAtenFallback, NonCpuTensorsTakeTheAtenPath) {
  // Meta tensors have no data: this checks dispatch and shapes, not values.
  const auto meta = at::TensorOptions(at::kMeta);
  const int64_t n = 5;
  const at::Tensor param = at::empty({n}, meta.dtype(at::kBFloat16));
  const at::Tensor rem = at::empty({n}, meta.dtype(at::kShort));
  AdamHyperParams hp;
  EXPECT_NO_THROW(fused_adam_step_remainder(param, rem, at::empty({n}, meta.dtype(at::kHalf)),
                                            at::empty({n}, meta), at::empty({n}, meta), {}, 1, hp));
  SgdHyperParams sgd;
  sgd.momentum = 0.5;
  EXPECT_NO_THROW(
      fused_sgd_step_remainder(param, rem, at::empty({n}, meta), at::empty({n}, meta), true, sgd));
}

}  // namespace MIXPREC_UNITY_ID
}  // namespace mixprec::optim
