// Checkpoints of the run: where they go, how they are written, and how a run finds its way back.
//
// A checkpoint root holds step-000100/, step-000200/, … and `latest`, the name of the newest
// (mixprec's durable format: docs/checkpoint-format.md). Each checkpoint carries, besides model
// and optimizer state, this program's user metadata:
//   {"program": "mixprec-train", "config": run_shape(config), "step": steps done,
//    "skipped_total": skipped steps, "elapsed_s": training time, "data_position": global
//    batches drawn, "metrics": the metrics file}
// A resumed run checks "config" before it loads a single tensor.
#pragma once

#include "mixprec/checkpoint/async_save.h"
#include "mixprec/sharded_state_dict.h"

#include <nlohmann/json.hpp>

#include <filesystem>
#include <memory>
#include <optional>
#include <string>

namespace mixprec::distributed {
class Communicator;
}

namespace train {

// "step-000100".
std::string checkpoint_name(int64_t step);

// The checkpoint `<root>/latest` names; nullopt if the root has none.
std::optional<std::filesystem::path> latest_checkpoint(const std::filesystem::path& root);

// A checkpoint's user metadata, read from its common state without loading any tensor data.
// Throws UsageError naming the checkpoint if it cannot be read.
nlohmann::json read_user_metadata(const std::filesystem::path& checkpoint);

// Creates `dir` (and parents) if missing and proves it writable by creating and removing a
// probe file. Throws UsageError naming `what` and the directory otherwise. Writes nothing else.
void ensure_writable_dir(const std::filesystem::path& dir, const std::string& what);

// Timings and sizes of the saves so far, for the summary.
struct SaveStats {
  int64_t saves = 0;
  double blocked_s = 0;       // time training waited for saves, all saves together
  double last_blocked_s = 0;  // … for the last save
  std::filesystem::path last_dir;
};

class Checkpointer {
 public:
  // `async`: stage to host memory and write in the background (AsyncCheckpointSaver); at most
  // one save in flight, the next save or finish() waits for it. `keep_last`: retention.
  // `ranks`: data parallel; every save is then collective (each rank writes its own shard,
  // rank 0 commits: mixprec/distributed/collective_checkpoint.h) and blocking — `async` with ranks
  // is a UsageError.
  Checkpointer(std::filesystem::path root, bool async, int64_t keep_last,
               std::shared_ptr<mixprec::distributed::Communicator> ranks = nullptr);

  // Saves `state` (this rank's part) as <root>/step-<step> and points `latest` at it. Blocking
  // saves return once committed; async ones once staged. Errors of a background save surface
  // here or in finish().
  void save(int64_t step, mixprec::ShardedStateDict state);
  // Waits for a background save to commit.
  void finish();

  const std::filesystem::path& root() const { return root_; }
  const SaveStats& stats() const { return stats_; }

 private:
  std::filesystem::path root_;
  int64_t keep_last_;
  std::unique_ptr<mixprec::checkpoint::AsyncCheckpointSaver> async_;
  std::shared_ptr<mixprec::distributed::Communicator> ranks_;
  SaveStats stats_;
};

// Bytes on disk of a checkpoint directory (its plain files).
uint64_t directory_bytes(const std::filesystem::path& dir);

}  // namespace train
