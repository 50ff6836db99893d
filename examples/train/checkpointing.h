// Checkpoints of the run: where they go, how they are written, and how a run finds its way back.
//
// A checkpoint root holds step-000100/, step-000200/, … and `latest`, the name of the newest
// (mixprec's durable format: docs/checkpoint-format.md). Each checkpoint carries, besides model
// and optimizer state, this program's user metadata:
//   {"program": "mixprec-train", "config": run_shape(config), "step": steps done,
//    "skipped_total": skipped steps, "elapsed_s": training time, "data_position": global
//    batches drawn, "text": the training text's fingerprint, "threads": intra-op threads per
//    rank, "cpu_kernels": what picks the CPU kernels (cpu_kernels.h), "metrics": the metrics file,
//    "metrics_from_root": the same from the checkpoint root when it lies in the run's directory
//    (else "")}
// A resumed run checks "config" before it loads a single tensor.
#pragma once

#include "config.h"
#include "mixprec/checkpoint/async_save.h"
#include "mixprec/checkpoint/format/root_lock.h"
#include "mixprec/sharded_state_dict.h"

#include <nlohmann/json.hpp>

#include <chrono>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

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
// it is damaged (an unusable `latest`). `note` receives why `latest` was not followed, if so;
// `unverified` the names of newer checkpoints passed over because they do not verify.
std::optional<std::filesystem::path> newest_checkpoint(
    const std::filesystem::path& root, std::string* note = nullptr,
    std::vector<std::string>* unverified = nullptr);

// Directories "step-N" of `root` with N above the step of `from` (a checkpoint name of the
// same form) that are not committed checkpoints (list_checkpoints, retention.h): a resume from
// `from` would meet them at their step's save. Sorted; empty if `from` is not of that form.
std::vector<std::string> uncommitted_steps_after(const std::filesystem::path& root,
                                                 const std::filesystem::path& from);

// For an error reading `checkpoint`, the one `latest` names in its root, which a resume reads
// without a separate verification pass (that would read it twice): if it is damaged (a file,
// chunk or checksum does not verify; this reads every byte), "; to resume from the newest
// checkpoint that verifies, delete <root>/latest" — without `latest`, --resume verifies, sets
// the damaged checkpoint aside and takes the newest one that verifies. Empty if it verifies:
// the error has another cause (another model, a newer format), and setting it aside would
// lose it.
std::string advice_if_damaged(const std::filesystem::path& checkpoint);

// A checkpoint's user metadata, read from its common state without loading any tensor data.
// Throws UsageError naming the checkpoint if it cannot be read.
nlohmann::json read_user_metadata(const std::filesystem::path& checkpoint);

// Creates `dir` (and parents) if missing and proves it writable by creating and removing a
// probe file (named by host, pid and random bits: ranks on several machines may share the
// directory).
// Throws UsageError naming `what` and the directory otherwise. Writes nothing else.
void ensure_writable_dir(const std::filesystem::path& dir, const std::string& what);

// True if another process holds the run lock of `dir` now (a look, not a wait; writes
// nothing: the answer may change at once).
bool held_by_another_run(const std::filesystem::path& dir);

// Runs `attempt` on every rank; a UsageError on any rank is thrown on every rank (the first
// failing rank's), so that no rank goes on into a collective the failed one never joins.
// Collective with several ranks (`ranks` may be null: one process).
void on_every_rank_or_none(mixprec::distributed::Communicator* ranks,
                           const std::function<void()>& attempt);

// One run per checkpoint root and per metrics file, held for the whole run by rank 0's
// process: the lock file <dir>/<lock_name> — the root's kRunLockFileName, so that a second run
// started on the same --ckpt-dir cannot commit into it, move `latest` or delete this run's
// checkpoints; ".<file>.run-lock" beside the metrics file, which a second run would truncate.
// Waits at most `wait` for a holder; then Busy naming `what` and the holder (host and pid).
// UsageError if the directory cannot be created or locked.
class RunLock {
 public:
  struct Busy : UsageError {
    using UsageError::UsageError;
  };
  // `what` names the thing locked in errors ("checkpoint directory").
  RunLock(const std::filesystem::path& dir, const std::string& lock_name, const std::string& what,
          std::chrono::milliseconds wait);
  ~RunLock();
  RunLock(const RunLock&) = delete;
  RunLock& operator=(const RunLock&) = delete;

 private:
  std::unique_ptr<mixprec::checkpoint::RootFileLock> held_;
};

// A RunLock on `dir`/`lock_name`, on every rank (`ranks` may be null: one process): rank 0 takes
// it, for up to `wait` (in slices, telling the others after each, so that no collective times out
// on a long wait); when it cannot, every rank throws its UsageError (the other ranks do not wait in
// a collective for a rank that has left). The lock, on rank 0; null elsewhere.
std::unique_ptr<RunLock> hold_run_dir(const std::filesystem::path& dir,
                                      const std::string& lock_name, const std::string& what,
                                      std::chrono::seconds wait,
                                      mixprec::distributed::Communicator* ranks);

// Collective. Checkpoints newer than the one a resume continues from that do not verify
// (`names`, from newest_checkpoint) are renamed by rank 0 to ".unverified-<name>-<unique>" in
// `root` — kept for inspection, out of the way of the run's save at their step, which would
// otherwise refuse to replace a committed checkpoint. `report` gets "<name> -> <new name>".
void set_aside_unverified(const std::filesystem::path& root, const std::vector<std::string>& names,
                          mixprec::distributed::Communicator* ranks,
                          std::vector<std::string>* report);

// Collective: every rank must see the checkpoint root rank 0 writes (several machines need a
// shared filesystem). Rank 0 writes a token file into `root`; every rank reads it back; a rank
// that cannot gets, on every rank, a UsageError naming the path and that rank's host — before
// training, not at the first save. Rank 0 removes the token.
void check_shared_root(const std::filesystem::path& root,
                       mixprec::distributed::Communicator& ranks);

// Timings and sizes of the saves so far, for the summary.
struct SaveStats {
  int64_t saves = 0;
  double blocked_s = 0;       // time training waited for saves, all saves together
  double last_blocked_s = 0;  // … for the last save
  // Async: how long the run's end waited for the last background save (finish()). Not training
  // blocked: no step was waiting; reported apart so the per-save figure means what it says.
  double end_wait_s = 0;
  // Async: saves that found the one before still being written and waited for it (part of
  // blocked_s): the background save takes longer than --ckpt-every's steps.
  int64_t waited_for_previous = 0;
  double waited_for_previous_s = 0;
  // Problems that did not fail a save (SaveResult::warnings: `latest` not updated, retention
  // that failed, …), each printed on stderr by rank 0 when its save's result arrived.
  int64_t warnings = 0;
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
  // Errors of a background save surface here or in finish(); its warnings are printed there.
  void save(int64_t step, mixprec::ShardedStateDict state);
  // Before anything writes the model or optimizer state (the next optimizer step): waits until
  // an async save in flight has copied it. Throws that copy's error.
  void before_state_changes();
  // Waits for a background save to commit.
  void finish();

  const std::filesystem::path& root() const { return root_; }
  const SaveStats& stats() const { return stats_; }

 private:
  void save_now(int64_t step, mixprec::ShardedStateDict state);
  void wait_for_previous_save(int64_t step);
  // Prints a save's warnings on stderr (rank 0: every rank gets the same result) and counts them.
  void report(const std::optional<mixprec::checkpoint::SaveResult>& result);
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
