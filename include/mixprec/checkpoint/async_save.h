// Asynchronous checkpoint saves: training waits at most while the state is copied to host memory.
//
// save() validates the state (exactly as save_checkpoint does, errors thrown right there) and
// returns; a background thread copies every tensor it will write into one host staging arena,
// then writes the copy — checksums, fsyncs, manifest, commit, `latest`, retention: the whole
// synchronous save, from memory no one else touches — or, with a Writer, whatever the caller
// gives it (a collective save on a process group of its own: distributed/
// collective_checkpoint.h, save_checkpoint_async). The state's tensors may be read meanwhile
// (the next step's forward and backward), but must not change until wait_until_staged()
// returns: call it before the next optimizer step (or anything else that writes the model or
// optimizer state — a forward in training mode writes buffers such as BatchNorm's running
// statistics: with such a model, call it before the forward). Training is blocked only for what of
// the copy the work in between did not hide — at worst the copy itself, when the state changes
// right after save().
//
// Memory. The arena is allocated once (reserve(), or the first save), its pages touched when it
// is allocated, and reused by every later save: a steady save allocates nothing. It is sized
// for the whole state (every replica-0 shard's bytes), so staging never waits for the writer;
// a state larger than the budget is refused, naming both sizes, by reserve() — call it when
// training starts, so that a save that cannot fit says so then and not at step 10 000, with
// what the state will need once stepped (the optimizer makes its moments at a parameter's
// first step): staging_bytes_when_stepped (checkpoint/training_state.h; for a ZeRO-1 rank,
// distributed/collective_checkpoint.h), not staging_bytes_for of the state at start.
//
// Consistency: a state dict aliases the live model and optimizer tensors, while its common
// state (the step count) is a snapshot taken when it was built. The saved state is a
// consistent snapshot because every tensor is copied before anything changes it, and a state
// whose tensors changed anyway is refused (c10::Error naming the keys, nothing written) —
// their version counters (ShardedTensor::version), which every in-place write and optimizer
// step bumps, are checked when save() starts and again after the last tensor is copied. Build
// the dict right before save(), and do not step before wait_until_staged().
//
// At most one save is in flight: save() first waits for the previous one, and so do wait(),
// reserve() and the destructor (which reports, never throws, an error nobody collected). An
// error while staging (a tensor changed, a copy failed) is thrown, once, by wait_until_staged()
// (or else by wait() or the next save()), and nothing is written — so, with a Writer of the
// caller's (a collective save), is an error save() finds in the state, and then the writer's
// error (the one every rank gets) follows at wait() or the next save(); an error of the
// writing, by the next wait() or save().
//
// Results: each save's SaveResult reaches the caller once, whether or not it calls wait()
// between saves. The save() or wait() that waits for it returns it; one that reserve(), or a
// save() that then threw, waited for is returned by the next save() or wait() (the destructor
// prints the warnings of one nobody collected on stderr). Log its `warnings`: the checkpoint is
// committed, but `latest` was not updated, retention failed, or a newer checkpoint does not verify.
// save() and wait() are [[nodiscard]]: a result dropped unread is a compiler warning.
#pragma once

#include "mixprec/checkpoint/save.h"

#include <torch/arg.h>

#include <condition_variable>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>

namespace mixprec::checkpoint {

struct AsyncSaveOptions {
  // Most host memory the staging arena may take (it takes what the state needs).
  TORCH_ARG(std::size_t, staging_budget_bytes) = std::size_t{4} << 30;
  // How much lower than the caller's the background thread's CPU priority is (a Linux nice
  // increment; 0 keeps the caller's). A save then takes only the cores training leaves idle —
  // and the staging copy, at the latest, the one wait_until_staged() frees — instead of slowing
  // the step it runs behind; its own end comes later (the next save or wait() waits for it).
  TORCH_ARG(int, background_niceness) = 19;
  // Called on the background thread after each tensor is copied, with its key (progress
  // reporting; tests use it to step the optimizer in the middle of staging).
  TORCH_ARG(std::function<void(const std::string& key)>, on_tensor_staged);
};

// The bytes the staging arena needs for `state`: each replica-0 shard's bytes, each rounded up
// to 64 (the alignment every staged tensor starts at). Before the first optimizer step a
// training state holds no moments yet: reserve training_state.h's staging_bytes_when_stepped.
std::size_t staging_bytes_for(const ShardedStateDict& state);
// The arena bytes one staged tensor of `tensor_bytes` bytes takes: rounded up to 64.
std::size_t staging_bytes_for(std::size_t tensor_bytes);

class AsyncCheckpointSaver {
 public:
  // The background half of a save: writes and commits the staged copy, returns the result.
  // It is called after a failure of this process's part too (the state could not be saved, did
  // not fit the budget, or changed while it was staged), with `failed` set (and `staged` not
  // to be read): then it writes nothing and throws — a collective writer after taking part in its
  // agreement with that error, so that every rank's save fails alike and the next saves of all
  // ranks stay paired.
  using Writer =
      std::function<SaveResult(const ShardedStateDict& staged, const std::exception_ptr& failed)>;

  // Throws c10::Error if the budget is 0 or background_niceness is outside [0, 19].
  explicit AsyncCheckpointSaver(AsyncSaveOptions options = {});
  ~AsyncCheckpointSaver();
  AsyncCheckpointSaver(const AsyncCheckpointSaver&) = delete;
  AsyncCheckpointSaver& operator=(const AsyncCheckpointSaver&) = delete;

  // Makes the arena at least `bytes` (staging_bytes_for a state) large, allocating it now and
  // touching its pages. Throws c10::Error naming both sizes if `bytes` exceeds the budget.
  // Waits for a save in flight first (the arena is its memory), rethrowing its error; its
  // result is kept for the next save() or wait() to return.
  void reserve(std::size_t bytes);

  // Starts saving `state` as <root>/<name> (save_checkpoint's rules); returns once it is
  // checked, before it is staged, with the previous save's result: the one it waited for, or
  // one not returned yet (above); nullopt if there is none. Rethrows the previous save's
  // background error, if any, before starting; throws c10::Error if `state` cannot be saved,
  // does not fit the budget, or changed since it was built (see above), and FormatError, as
  // save_checkpoint does, for an invalid or reserved name or an existing <root>/<name> — having
  // thrown, it returned no result: the previous save's is the next save()'s or wait()'s.
  [[nodiscard]] std::optional<SaveResult> save(const std::filesystem::path& root,
                                               const std::string& name, ShardedStateDict state,
                                               const SaveOptions& options = {});
  // The same with `write` as the background half (it gets the staged copy: the same keys,
  // shards and common state, each written tensor a contiguous host copy). Errors of this
  // process's part are not thrown here but given to `write` and thrown by
  // wait_until_staged() (see Writer).
  [[nodiscard]] std::optional<SaveResult> save(ShardedStateDict state, Writer write);

  // Returns once the save in flight (if any) has copied its state: from then on the state may
  // change. Throws its staging error at once (a Writer's own error about it, such as a
  // collective save's agreed one, follows at wait() or the next save()).
  void wait_until_staged();
  // Waits for the save in flight; returns its result, or rethrows its error. With none in
  // flight, returns a result not returned yet (reserve(), or a save() that then threw, waited
  // for it), else nullopt.
  [[nodiscard]] std::optional<SaveResult> wait();

  bool in_flight() const { return worker_.joinable(); }
  // The arena's size (0 before the first reserve or save).
  std::size_t staging_bytes() const { return arena_bytes_; }
  // Seconds the caller spent in the last save() (waiting for the previous save, checks) and in
  // wait_until_staged() for it: the time training was blocked by the save.
  double last_blocked_seconds() const { return last_blocked_seconds_; }
  // The two below are written by the background thread: read them after wait_until_staged()
  // (staging) or wait() (both), not while a save is in flight.
  // Seconds the last completed staging copy took on the background thread.
  double last_staging_seconds() const { return last_staging_seconds_; }
  // Seconds the last completed writing took on the background thread (after staging: files,
  // checksums, fsyncs, commit).
  double last_background_seconds() const { return last_background_seconds_; }

 private:
  // Both save()s: `defer_errors` gives an error of this process's part to `write` instead of
  // throwing it. Returns the previous save's result, as save() does.
  std::optional<SaveResult> start(ShardedStateDict state, Writer write, bool defer_errors);
  // Waits for the save in flight (if any), moving its result to unreturned_; rethrows its error.
  void finish_in_flight();

  AsyncSaveOptions options_;
  at::Tensor arena_;  // uint8, the staging memory
  std::size_t arena_bytes_ = 0;
  ShardedStateDict state_;                // what is being saved (aliases live tensors until staged)
  ShardedStateDict staged_;               // its copy in the arena, which the background half writes
  std::optional<SaveResult> result_;      // the save in flight's, written by the background half
  std::optional<SaveResult> unreturned_;  // a finished save's, for the next save() or wait()
  std::exception_ptr error_;
  std::exception_ptr reported_;  // a staging error wait_until_staged() threw: wait() skips it
  bool writer_reports_ = false;  // the save in flight has a Writer that reports its failures
  // Staging's end, signalled by the background thread.
  std::mutex mutex_;
  std::condition_variable staged_signal_;
  bool staging_ = false;
  std::exception_ptr staging_error_;
  double last_blocked_seconds_ = 0;
  double last_staging_seconds_ = 0;
  double last_background_seconds_ = 0;
  std::thread worker_;
};

}  // namespace mixprec::checkpoint
