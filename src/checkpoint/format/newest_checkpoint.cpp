#include "mixprec/checkpoint/format/newest_checkpoint.h"

#include "mixprec/checkpoint/format/error.h"
#include "mixprec/checkpoint/format/latest.h"
#include "mixprec/checkpoint/format/retention.h"
#include "mixprec/checkpoint/format/verify.h"

#include <algorithm>

namespace mixprec::checkpoint {

NewestCheckpoint find_newest_checkpoint(const Directory& root) {
  NewestCheckpoint out;
  try {
    out.recorded = read_latest(root);
  } catch (const FormatError& e) {
    out.latest_error = e.what();
  }
  const std::vector<CheckpointInfo> checkpoints = list_checkpoints(root);
  // The sequence `latest` stands for; 0 when it names nothing listable (no `latest`, or a
  // directory without a readable manifest), so that every listed checkpoint is newer.
  std::uint64_t recorded_sequence = 0;
  for (const CheckpointInfo& c : checkpoints) {
    if (c.name == out.recorded) recorded_sequence = c.sequence;
  }
  out.name = out.recorded;
  for (auto it = checkpoints.rbegin(); it != checkpoints.rend(); ++it) {
    if (it->sequence <= recorded_sequence) break;
    if (it->name == out.recorded) continue;
    try {
      verify_checkpoint(root.subdirectory(it->name));
      out.name = it->name;
      break;
    } catch (const FormatError& e) {
      out.skipped.push_back({it->name, e.what()});
    }
  }
  return out;
}

std::string NewestCheckpoint::note() const {
  std::string out;
  if (latest_is_stale()) {
    out = (recorded ? "'latest' names '" + *recorded + "', but '" + *name +
                          "' is newer and complete (a save ended between its commit and the "
                          "'latest' update)"
                    : "there is no 'latest'; '" + *name + "' is the newest complete checkpoint") +
          ": loading '" + *name + "'; the next save repairs 'latest'";
  }
  for (const Skipped& s : skipped) {
    out += std::string(out.empty() ? "" : "; ") + "newer but does not verify: " + s.name + ": " +
           s.error;
  }
  return out;
}

}  // namespace mixprec::checkpoint
