// metrics.jsonl's records: every field survives a round trip, and lines written before a field
// existed still read (as 0), so that a resumed run keeps an older run's history.
#include "metrics.h"

#include <gtest/gtest.h>

namespace train {
namespace MIXPREC_UNITY_ID {  // anonymous outside unity builds (tests/CMakeLists.txt)

TEST(StepRecord, RoundTripsEveryField) {
  StepRecord r;
  r.step = 7;
  r.loss = 2.5;
  r.aux_loss = 0.25;
  r.val_loss = 2.75;
  r.lr = 1e-3;
  r.grad_norm = 0.5;
  r.skipped_total = 1;
  r.tokens = 7 * 2048;
  r.tokens_per_s = 30000;
  r.step_s = 0.07;
  r.elapsed_s = 0.5;
  r.phases = {0.02, 0.04, 0.001, 0.002, 0.003, 0.004};
  r.page_faults = 12;
  const StepRecord back = StepRecord::from_json(r.to_json());
  EXPECT_EQ(back.to_json(), r.to_json());
  EXPECT_EQ(back.page_faults, 12);
  EXPECT_EQ(back.phases.backward_s, 0.04);
}

TEST(StepRecord, ALineFromBeforeThePhasesAndPageFaultsReadsThemAsZero) {
  const nlohmann::json old = nlohmann::json::parse(
      R"({"step":3,"loss":4.9,"aux_loss":1.0,"val_loss":null,"lr":0.0006,"grad_norm":2.5,)"
      R"("loss_scale":1.0,"skipped":false,"skipped_total":0,"tokens":6144,"tokens_per_s":28000.0,)"
      R"("step_s":0.07,"elapsed_s":0.3})");
  const StepRecord r = StepRecord::from_json(old);
  EXPECT_EQ(r.step, 3);
  EXPECT_EQ(r.page_faults, 0);
  EXPECT_EQ(r.phases.timed_s(), 0.0);
  EXPECT_FALSE(r.val_loss.has_value());
}

}  // namespace MIXPREC_UNITY_ID
}  // namespace train
