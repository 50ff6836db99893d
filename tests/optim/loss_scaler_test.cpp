#include "mixprec/optim/loss_scaler.h"

#include "support/error_message.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

namespace mixprec::optim {
namespace MIXPREC_UNITY_ID {  // anonymous outside unity builds (tests/CMakeLists.txt)

TEST(LossScaler, ConstantIgnoresOverflow) {
  LossScaler s;
  s.update(true);
  s.update(false);
  EXPECT_EQ(s.scale(), 1.0);
}

TEST(LossScaler, DynamicBacksOffAfterHysteresisAndGrowsAfterInterval) {
  LossScalerOptions o = LossScalerOptions::fp16_dynamic();
  o.growth_interval(3);
  o.hysteresis(2);
  LossScaler s(o);
  EXPECT_EQ(s.scale(), 65536.0);
  s.update(true);  // hysteresis 2 -> 1: no backoff yet
  EXPECT_EQ(s.scale(), 65536.0);
  s.update(true);  // spent: backoff
  EXPECT_EQ(s.scale(), 32768.0);
  s.update(true);  // still spent: backs off on every overflow until growth refills it
  EXPECT_EQ(s.scale(), 16384.0);
  s.update(false);
  s.update(false);
  EXPECT_EQ(s.scale(), 16384.0);
  s.update(false);  // third clean step in a row: grow, hysteresis refilled
  EXPECT_EQ(s.scale(), 32768.0);
  s.update(true);
  EXPECT_EQ(s.scale(), 32768.0);
}

TEST(LossScaler, RespectsMinAndMax) {
  LossScalerOptions o = LossScalerOptions::fp16_dynamic();
  o.hysteresis(1);
  o.min_scale(16384.0);
  o.max_scale(65536.0);
  o.growth_interval(1);
  LossScaler s(o);
  for (int i = 0; i < 5; ++i) s.update(true);
  EXPECT_EQ(s.scale(), 16384.0);
  for (int i = 0; i < 5; ++i) s.update(false);
  EXPECT_EQ(s.scale(), 65536.0);
}

TEST(LossScaler, StateRoundTripsAndBadStateIsRejected) {
  LossScalerOptions o = LossScalerOptions::fp16_dynamic();
  LossScaler a(o), b(o);
  a.update(true);
  a.update(true);
  a.update(false);
  b.load_state(a.state());
  EXPECT_EQ(b.state(), a.state());
  const nlohmann::json before = b.state();
  EXPECT_THROW(b.load_state({{"scale", -1.0}, {"growth_tracker", 0}, {"hysteresis_tracker", 1}}),
               c10::Error);
  EXPECT_THROW(b.load_state({{"scale", 2.0}}), c10::Error);
  // Trackers are counts: a fraction is a corrupt state, not something to truncate.
  EXPECT_THROW(b.load_state({{"scale", 2.0}, {"growth_tracker", 0.5}, {"hysteresis_tracker", 1}}),
               c10::Error);
  // A negative count names its field.
  for (const char* field : {"growth_tracker", "hysteresis_tracker"}) {
    nlohmann::json bad = {{"scale", 2.0}, {"growth_tracker", 0}, {"hysteresis_tracker", 1}};
    bad[field] = -3;
    EXPECT_EQ(mixprec::testing::error_of([&] { b.load_state(bad); }),
              std::string("[mixprec::LossScaler::load_state] field '") + field +
                  "' must not be negative, got -3");
  }
  EXPECT_EQ(b.state(), before);
}

TEST(LossScaler, BadOptionsNameTheField) {
  LossScalerOptions o;
  o.growth_factor(1.0);
  try {
    LossScaler s(o);
    FAIL();
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("growth_factor"), std::string::npos);
  }
  o = LossScalerOptions{};
  o.backoff_factor(1.5);
  EXPECT_THROW(LossScaler{o}, c10::Error);
  // A scale whose inverse overflows would fail every update() with a message about something
  // else (the unscaling factor): refused here, naming it.
  o = LossScalerOptions{};
  o.initial_scale(1e-310);
  EXPECT_NE(mixprec::testing::error_of([&] { LossScaler{o}; }).find("initial_scale must be"),
            std::string::npos);
  o = LossScalerOptions::fp16_dynamic();
  o.min_scale(1e-310);
  EXPECT_NE(mixprec::testing::error_of([&] { LossScaler{o}; }).find("min_scale <= max_scale"),
            std::string::npos);
}

// an overflow restarts the count of clean steps (Megatron's DynamicGradScaler).
TEST(LossScaler, OverflowRestartsTheGrowthCount) {
  LossScalerOptions o = LossScalerOptions::fp16_dynamic();
  o.growth_interval(3);
  o.hysteresis(5);  // the overflow below does not back off: only the count is under test
  LossScaler s(o);
  s.update(false);
  s.update(false);
  s.update(true);  // two clean steps are forgotten here
  s.update(false);
  s.update(false);
  EXPECT_EQ(s.scale(), 65536.0) << "only 2 clean steps since the overflow";
  s.update(false);
  EXPECT_EQ(s.scale(), 131072.0);
}

// A state saved under other limits is brought inside this scaler's (the scale into
// [min_scale, max_scale], the growth count below growth_interval, the hysteresis count at most
// hysteresis), so the next updates behave as this configuration says.
TEST(LossScaler, LoadedStateIsBroughtInsideTheConfiguredLimits) {
  LossScalerOptions o = LossScalerOptions::fp16_dynamic();
  o.min_scale(1024.0).max_scale(65536.0).growth_interval(4).hysteresis(2);
  LossScaler s(o);
  s.load_state({{"scale", 1e9}, {"growth_tracker", 100}, {"hysteresis_tracker", 7}});
  EXPECT_EQ(s.scale(), 65536.0);
  EXPECT_EQ(s.state().at("growth_tracker"), 3);
  EXPECT_EQ(s.state().at("hysteresis_tracker"), 2);
  s.update(true);  // hysteresis 2 -> 1: no backoff yet
  EXPECT_EQ(s.scale(), 65536.0);
  s.update(true);
  EXPECT_EQ(s.scale(), 32768.0);
  s.load_state({{"scale", 2.0}, {"growth_tracker", 100}, {"hysteresis_tracker", 1}});
  EXPECT_EQ(s.scale(), 1024.0);
  s.update(false);  // the fourth clean step in a row
  EXPECT_EQ(s.scale(), 2048.0);
}

// A constant scale is configuration: a saved one does not replace it.
TEST(LossScaler, ConstantScaleIgnoresTheSavedScale) {
  LossScaler s(LossScalerOptions().initial_scale(8.0));
  s.load_state({{"scale", 2.0}, {"growth_tracker", 0}, {"hysteresis_tracker", 1}});
  EXPECT_EQ(s.scale(), 8.0);
}

}  // namespace MIXPREC_UNITY_ID
}  // namespace mixprec::optim
