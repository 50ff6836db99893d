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
#include "mixprec/checkpoint/format/root_lock.h"
#include "mixprec/sharded_state_dict.h"

#include <nlohmann/json.hpp>

#include <chrono>
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

// The checkpoint a resume of `root` continues from: the newest complete one, whatever
// `latest` says (the library's lookup, checkpoint/load.h: find_checkpoint) — a save that died
// between its commit and the `latest` update, or before the first `latest` existed, is found
// again. nullopt if the root is missing or holds no checkpoint; UsageError naming the root if
// it is damaged (an unusable `latest`). `note` receives why `latest` was not followed, if so.
std::optional<std::filesystem::path> newest_checkpoint(const std::filesystem::path& root,
                                                       std::string* note = nullptr);

// A checkpoint's user metadata, read from its common state without loading any tensor data.
// Throws UsageError naming the checkpoint if it cannot be read.
nlohmann::json read_user_metadata(const std::filesystem::path& checkpoint);

// Creates `dir` (and parents) if missing and proves it writable by creating and removing a
// probe file (named by host and pid: ranks on several machines may share the directory).
// Throws UsageError naming `what` and the directory otherwise. Writes nothing else.
void ensure_writable_dir(const std::filesystem::path& dir, const std::string& what);

// One run per checkpoint root: held for the whole run (rank 0's process), so that a second
// run started on the same --ckpt-dir cannot commit into it, move `latest` or delete this
// run's checkpoints. `wait` bounds how long to wait for a holder; then UsageError naming the
// directory and the holder (host and pid).
class RunLock {
 public:
  RunLock(const std::filesystem::path& root, std::chrono::seconds wait);
  ~RunLock();
  RunLock(const RunLock&) = delete;
  RunLock& operator=(const RunLock&) = delete;

 private:
  std::unique_ptr<mixprec::checkpoint::RootFileLock> held_;
};

// Collective: every rank must see the checkpoint root rank 0 writes (several machines need a
// shared filesystem). Rank 0 writes a token file into `root`; every rank reads it back; a rank
// that cannot gets, on every rank, a UsageError naming the path and that rank's host — before
// training, not at the first save. Rank 0 removes the token.
void check_shared_root(const std::filesystem::path& root,
                       mixprec::distributed::Communicator& ranks);

// Both of the above, on every rank (`ranks` may be null: one process): rank 0 takes the run
// lock, and when it cannot, every rank throws its UsageError (the other ranks do not wait in
// a collective for a rank that has left). The lock, on rank 0; null elsewhere.
std::unique_ptr<RunLock> hold_checkpoint_root(const std::filesystem::path& root,
                                              std::chrono::seconds wait,
                                              mixprec::distributed::Communicator* ranks);

// Timings and sizes of the saves so far, for the summary.
struct SaveStats {
  int64_t saves = 0;
  double blocked_s = 0;       // time training waited for saves, all saves together
  double last_blocked_s = 0;  // … for the last save
  std::filesystem::path last_dir;
};

struct CheckpointerOptions {
  // Copy the state to host memory, then write it in the background (AsyncCheckpointSaver; on
  // several ranks the collective save runs on a process group of its own); at most one save in
  // flight, the next save or finish() waits for it.
  bool async = false;
  int64_t keep_last = 3;                          // retention
  std::size_t staging_budget_bytes = 4u << 30;    // async: host memory for the copy
  std::chrono::seconds collective_timeout{1800};  // async on several ranks: the save's group
};

class Checkpointer {
 public:
  // `ranks`: data parallel; every save is then collective (each rank writes its own shard,
  // rank 0 commits: mixprec/distributed/collective_checkpoint.h). Collective with ranks and
  // `async` (every rank forms the checkpoint group here).
  Checkpointer(std::filesystem::path root, const CheckpointerOptions& options,
               std::shared_ptr<mixprec::distributed::Communicator> ranks = nullptr);

  // Async: sets the staging memory aside now, for states of `bytes` (TrainingOptimizer::
  // checkpoint_bytes); a UsageError naming both sizes and --staging-budget-mb if it does not fit,
  // before the first step. No-op for synchronous saves.
  void prepare(std::size_t bytes);
  // Saves `state` (this rank's part) as <root>/step-<step> and points `latest` at it. Blocking
  // saves return once committed; async ones once checked: the copy follows in the background.
  // Errors of a background save surface here or in finish().
  void save(int64_t step, mixprec::ShardedStateDict state);
  // Before anything writes the model or optimizer state (the next optimizer step): waits until
  // an async save in flight has copied it. Throws that copy's error.
  void before_state_changes();
  // Waits for a background save to commit.
  void finish();

  const std::filesystem::path& root() const { return root_; }
  const SaveStats& stats() const { return stats_; }

 private:
  std::filesystem::path root_;
  CheckpointerOptions options_;
  std::unique_ptr<mixprec::checkpoint::AsyncCheckpointSaver> async_;
  std::shared_ptr<mixprec::distributed::Communicator> ranks_;
  std::shared_ptr<mixprec::distributed::Communicator> checkpoint_ranks_;  // async, several ranks
  SaveStats stats_;
};

// Bytes on disk of a checkpoint directory (its plain files).
uint64_t directory_bytes(const std::filesystem::path& dir);

}  // namespace train
