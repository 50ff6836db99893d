// The learning-rate schedule: linear warm-up to the peak, cosine decay to exactly
// lr · min_lr_ratio at the last step.
#include "schedule.h"

#include <gtest/gtest.h>

namespace train {
namespace MIXPREC_UNITY_ID {  // anonymous outside unity builds (tests/CMakeLists.txt)

TEST(Schedule, WarmsUpToThePeakAndDecaysToTheFloorAtTheLastStep) {
  const double lr = 6e-3, floor = 0.1;
  EXPECT_DOUBLE_EQ(learning_rate(0, 600, lr, 30, floor), lr / 30);
  EXPECT_DOUBLE_EQ(learning_rate(29, 600, lr, 30, floor), lr);
  EXPECT_DOUBLE_EQ(learning_rate(30, 600, lr, 30, floor), lr) << "the first decayed step";
  EXPECT_DOUBLE_EQ(learning_rate(599, 600, lr, 30, floor), lr * floor) << "the last step";
  // Halfway through the decay (steps 0–600 of 601, no warm-up) the cosine is at its middle.
  EXPECT_DOUBLE_EQ(learning_rate(300, 601, lr, 0, floor), lr * (floor + (1 - floor) / 2));
  for (int64_t step = 30; step < 599; ++step) {
    EXPECT_GT(learning_rate(step, 600, lr, 30, floor), learning_rate(step + 1, 600, lr, 30, floor))
        << "decays at every step: " << step;
  }
}

TEST(Schedule, ShortRunsReachTheFloorToo) {
  const double lr = 6e-3, floor = 0.1;
  EXPECT_DOUBLE_EQ(learning_rate(4, 5, lr, 0, floor), lr * floor);
  EXPECT_DOUBLE_EQ(learning_rate(0, 5, lr, 0, floor), lr);
  // One step after warm-up: it is both the first decayed step and the last.
  EXPECT_DOUBLE_EQ(learning_rate(2, 3, lr, 2, floor), lr);
  EXPECT_DOUBLE_EQ(learning_rate(0, 1, lr, 0, floor), lr);
}

}  // namespace MIXPREC_UNITY_ID
}  // namespace train
