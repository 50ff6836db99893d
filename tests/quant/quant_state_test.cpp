#include "mixprec/quant/quant_state.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <stdexcept>
#include <thread>

namespace mixprec::quant {
namespace MIXPREC_UNITY_ID {  // anonymous outside unity builds (tests/CMakeLists.txt)

QuantConfig fp8_only() { return QuantConfig().fp8(Fp8Recipe::kHybrid); }
QuantConfig fp4_only() { return QuantConfig().fp4(Fp4Recipe::kNvFp4); }
QuantConfig fp8_param() { return QuantConfig().fp8(Fp8Recipe::kE4M3).fp8_param(true); }
QuantConfig fp4_param() { return QuantConfig().fp4(Fp4Recipe::kNvFp4).fp4_param(true); }

const QuantScopeState kOn8{true, QuantFormat::kFp8Hybrid};

TEST(QuantConfig, ConflictsAreErrorsNamingTheFields) {
  auto expect_error = [](QuantConfig c, const std::string& needle) {
    try {
      c.validate();
      FAIL() << "expected an error for " << c.to_string();
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what_without_backtrace()).find(needle), std::string::npos)
          << e.what_without_backtrace();
    }
  };
  expect_error(QuantConfig().fp8(Fp8Recipe::kE4M3).fp4(Fp4Recipe::kNvFp4),
               "fp8=e4m3 and fp4=nvfp4");
  expect_error(QuantConfig().fp8_param(true), "fp8_param=true needs fp8");
  expect_error(QuantConfig().fp4_param(true), "fp4_param=true needs fp4");
  EXPECT_NO_THROW(fp8_param().validate());
}

// The upstream PR left these branches untested: with nothing on, the guard is a no-op that
// neither reads nor writes any scope, for both is_init values.
TEST(Fp8DisabledContext, AllFlagsOffIsANoOpForBothInitValues) {
  const QuantConfig off{};
  for (bool is_init : {false, true}) {
    QuantAutocastGuard outer(true, QuantFormat::kFp8E4M3);
    QuantModelInitGuard outer_init(true, QuantFormat::kFp8E4M3);
    const uint64_t writes = detail::scope_state_writes();
    {
      auto guard = fp8_disabled_context(off, is_init);
      EXPECT_FALSE(guard.active());
      EXPECT_EQ(detail::scope_state_writes(), writes);
      EXPECT_TRUE(autocast_state().enabled);
      EXPECT_TRUE(model_init_state().enabled);
    }
    EXPECT_EQ(detail::scope_state_writes(), writes);
  }
}

TEST(Fp8DisabledContext, Fp8OnlyDisablesAutocastNotInit) {
  QuantAutocastGuard on(fp8_only());
  EXPECT_EQ(autocast_state(), kOn8);
  {
    auto guard = fp8_disabled_context(fp8_only(), /*is_init=*/false);
    EXPECT_TRUE(guard.active());
    EXPECT_FALSE(guard.disables_init());
    EXPECT_FALSE(autocast_state().enabled);
  }
  EXPECT_EQ(autocast_state(), kOn8);
  // No fp8_param: the init variant has nothing to disable.
  const uint64_t writes = detail::scope_state_writes();
  auto init_guard = fp8_disabled_context(fp8_only(), /*is_init=*/true);
  EXPECT_FALSE(init_guard.active());
  EXPECT_EQ(detail::scope_state_writes(), writes);
}

// Transformer Engine runs FP4 through the same autocast context: so do we.
TEST(Fp8DisabledContext, Fp4OnlyReachesTheAutocastPath) {
  QuantAutocastGuard on(fp4_only());
  EXPECT_EQ(autocast_state(), (QuantScopeState{true, QuantFormat::kNvFp4}));
  {
    auto guard = fp8_disabled_context(fp4_only(), /*is_init=*/false);
    EXPECT_TRUE(guard.active());
    EXPECT_EQ(autocast_state(), (QuantScopeState{false, QuantFormat::kNvFp4}));
  }
  EXPECT_TRUE(autocast_state().enabled);
}

TEST(Fp8DisabledContext, ParamFlagsDisableTheInitScope) {
  for (const QuantConfig& config : {fp8_param(), fp4_param()}) {
    QuantModelInitGuard init(config);
    ASSERT_TRUE(model_init_state().enabled) << config.to_string();
    const QuantScopeState autocast_before = autocast_state();
    {
      auto guard = fp8_disabled_context(config, /*is_init=*/true);
      EXPECT_TRUE(guard.active());
      EXPECT_TRUE(guard.disables_init());
      EXPECT_FALSE(model_init_state().enabled) << config.to_string();
      EXPECT_EQ(autocast_state(), autocast_before);
    }
    EXPECT_TRUE(model_init_state().enabled) << config.to_string();
  }
  QuantModelInitGuard init(fp4_param());
  EXPECT_EQ(model_init_state().format, QuantFormat::kNvFp4);
}

TEST(Fp8DisabledContext, NestsAndRestoresExactly) {
  const QuantScopeState start = autocast_state();
  {
    auto off1 = fp8_disabled_context(fp8_only(), false);
    EXPECT_FALSE(autocast_state().enabled);
    {
      QuantAutocastGuard on(fp8_only());
      EXPECT_TRUE(autocast_state().enabled);
      {
        auto off2 = fp8_disabled_context(fp8_only(), false);
        EXPECT_FALSE(autocast_state().enabled);
      }
      EXPECT_EQ(autocast_state(), kOn8);
    }
    EXPECT_FALSE(autocast_state().enabled);
  }
  EXPECT_EQ(autocast_state(), start);
}

TEST(Fp8DisabledContext, RestoresOnException) {
  QuantAutocastGuard on(fp8_only());
  QuantModelInitGuard init(fp8_param());
  try {
    auto guard = fp8_disabled_context(fp8_only(), false);
    auto init_guard = fp8_disabled_context(fp8_param(), true);
    throw std::runtime_error("boom");
  } catch (const std::runtime_error&) {
  }
  EXPECT_EQ(autocast_state(), kOn8);
  EXPECT_TRUE(model_init_state().enabled);
}

TEST(Fp8DisabledContext, OtherThreadsAreUnaffected) {
  QuantAutocastGuard on(fp8_only());
  QuantScopeState seen_in_other;
  std::thread([&] { seen_in_other = autocast_state(); }).join();
  EXPECT_FALSE(seen_in_other.enabled);

  // A guard in another thread does not reach this one, even while it is alive.
  std::atomic<int> phase{0};
  std::thread other([&] {
    auto guard = fp8_disabled_context(fp8_only(), false);
    QuantModelInitGuard init(fp8_param());
    phase = 1;
    while (phase != 2) std::this_thread::yield();
  });
  while (phase != 1) std::this_thread::yield();
  EXPECT_EQ(autocast_state(), kOn8);
  EXPECT_FALSE(model_init_state().enabled);
  phase = 2;
  other.join();
  EXPECT_EQ(autocast_state(), kOn8);
}

TEST(Fp8DisabledContext, InvalidConfigThrowsBeforeTouchingState) {
  const uint64_t writes = detail::scope_state_writes();
  const QuantConfig bad = QuantConfig().fp8(Fp8Recipe::kE4M3).fp4(Fp4Recipe::kNvFp4);
  EXPECT_THROW((void)fp8_disabled_context(bad, false), c10::Error);
  EXPECT_THROW(QuantAutocastGuard{bad}, c10::Error);
  EXPECT_EQ(detail::scope_state_writes(), writes);
  EXPECT_FALSE(autocast_state().enabled);
}

// The init scope carries the recipe of its config: the hybrid recipe's format is kFp8Hybrid,
// enabled in the guard and kept, off, in the disabled context (so code inside can tell which
// recipe is held off).
TEST(Fp8DisabledContext, ParamScopesCarryTheirRecipesFormat) {
  const QuantConfig hybrid_param = QuantConfig().fp8(Fp8Recipe::kHybrid).fp8_param(true);
  QuantModelInitGuard init(hybrid_param);
  EXPECT_EQ(model_init_state(), (QuantScopeState{true, QuantFormat::kFp8Hybrid}));
  {
    auto guard = fp8_disabled_context(hybrid_param, /*is_init=*/true);
    EXPECT_EQ(model_init_state(), (QuantScopeState{false, QuantFormat::kFp8Hybrid}));
  }
  QuantModelInitGuard e4m3(fp8_param());
  EXPECT_EQ(model_init_state(), (QuantScopeState{true, QuantFormat::kFp8E4M3}));
}

// scope_state_writes counts every write of a scope, entering and leaving: the no-op checks
// above rely on it moving when a guard does act.
TEST(Fp8DisabledContext, EveryScopeWriteIsCounted) {
  const uint64_t writes = detail::scope_state_writes();
  {
    QuantAutocastGuard on(fp8_only());
    EXPECT_EQ(detail::scope_state_writes(), writes + 1);
    auto off = fp8_disabled_context(fp8_only(), /*is_init=*/false);
    EXPECT_EQ(detail::scope_state_writes(), writes + 2);
  }
  EXPECT_EQ(detail::scope_state_writes(), writes + 4);
  { QuantModelInitGuard init(fp8_param()); }
  EXPECT_EQ(detail::scope_state_writes(), writes + 6);
}

}  // namespace MIXPREC_UNITY_ID
}  // namespace mixprec::quant
