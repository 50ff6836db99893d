// "Nothing in memory changed": a snapshot of every model and optimizer tensor plus the
// optimizer's common state, and the check that a failed load left them exactly as they were.
#pragma once

#include "checkpoint/support_training.h"
#include "mixprec/sharded_state_dict.h"

#include <gtest/gtest.h>

namespace mixprec::testing {

// Every tensor of model and optimizer, plus the optimizer's common state, for comparisons.
inline ShardedStateDict snapshot(TrainingSetup& s) {
  ShardedStateDict out = model_sharded_state_dict(*s.model).clone();
  out.merge(s.optimizer->sharded_state_dict().clone());
  return out;
}

inline void expect_unchanged(TrainingSetup& s, const ShardedStateDict& before) {
  const ShardedStateDict now = snapshot(s);
  ASSERT_EQ(now.tensors.size(), before.tensors.size());
  for (const auto& [key, t] : before.tensors) {
    EXPECT_TRUE(at::equal(now.at(key).local, t.local)) << key;
  }
  EXPECT_EQ(now.common, before.common);
}

}  // namespace mixprec::testing
