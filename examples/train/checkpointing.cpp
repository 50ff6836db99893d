#include "checkpointing.h"

#include "config.h"

#include "mixprec/checkpoint/format/error.h"
#include "mixprec/checkpoint/format/newest_checkpoint.h"
#include "mixprec/checkpoint/format/retention.h"
#include "mixprec/checkpoint/format/root_layout.h"
#include "mixprec/checkpoint/format/root_lock.h"
#include "mixprec/checkpoint/format/state_keys.h"
#include "mixprec/checkpoint/format/verify.h"
#include "mixprec/checkpoint/load.h"
#include "mixprec/checkpoint/save.h"
#include "mixprec/distributed/collective_checkpoint.h"
#include "mixprec/distributed/init.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <random>
#include <regex>
#include <set>
#include <stdexcept>

namespace train {
namespace fs = std::filesystem;
namespace keys = mixprec::checkpoint::keys;

namespace {

std::string host_name() {
  char name[256] = {};
  if (::gethostname(name, sizeof name - 1) != 0) return "unknown-host";
  return name;
}

// Host, pid and 64 random bits: containers on several machines may share a host name and,
// in their own pid namespaces, a pid.
std::string unique_suffix() {
  std::random_device random;
  const uint64_t bits = (uint64_t{random()} << 32) | random();
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(bits));
  return host_name() + "-" + std::to_string(::getpid()) + "-" + hex;
}

// The holder named by RunLock's error: another run, not a damaged directory.
constexpr const char* kBusyReason = "another mixprec-train run is using this directory";

// Signalled to the other ranks while rank 0 waits for a run lock.
constexpr const char* kStillWaiting = "\x01waiting";

}  // namespace

void on_every_rank_or_none(mixprec::distributed::Communicator* ranks,
                           const std::function<void()>& attempt) {
  const bool several = ranks != nullptr && ranks->size() > 1;
  std::string refused;
  try {
    attempt();
  } catch (const UsageError& e) {
    if (!several) throw;
    refused = e.what();
  }
  if (!several) return;
  for (const std::string& message : ranks->all_gather_strings(refused)) {
    if (!message.empty()) throw UsageError(message);
  }
}

std::string checkpoint_name(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step-%06lld", static_cast<long long>(step));
  return buf;
}

std::optional<fs::path> newest_checkpoint(const fs::path& root, std::string* note,
                                          std::vector<std::string>* unverified) {
  std::error_code ec;
  if (!fs::exists(root, ec)) return std::nullopt;
  try {
    const mixprec::checkpoint::Directory dir = mixprec::checkpoint::Directory::open(
        root, mixprec::checkpoint::Directory::Last::kMayBeLink);
    const mixprec::checkpoint::NewestCheckpoint newest =
        mixprec::checkpoint::find_newest_checkpoint(dir);
    if (!newest.latest_error.empty()) {
      throw UsageError("checkpoint root " + root.string() + " is damaged: " + newest.latest_error);
    }
    if (!newest.name) return std::nullopt;
    if (note != nullptr) *note = newest.note();
    if (unverified != nullptr) {
      unverified->clear();
      for (const auto& skipped : newest.skipped) unverified->push_back(skipped.name);
    }
    return root / *newest.name;
  } catch (const mixprec::checkpoint::FormatError& e) {
    throw UsageError(std::string("checkpoint root ") + root.string() + " is damaged: " + e.what());
  }
}

std::vector<std::string> uncommitted_steps_after(const fs::path& root, const fs::path& from) {
  static const std::regex step_name("step-([0-9]+)");
  std::smatch from_step;
  const std::string from_name = from.string();
  if (!std::regex_match(from_name, from_step, step_name)) return {};
  const long long after = std::stoll(from_step[1].str());
  // What the library counts as committed (retention.h), not a second definition of it.
  std::set<std::string> committed;
  for (const auto& c : mixprec::checkpoint::list_checkpoints(root)) committed.insert(c.name);
  std::vector<std::string> names;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(root, ec)) {
    const std::string name = entry.path().filename().string();
    std::smatch step;
    if (!std::regex_match(name, step, step_name) || std::stoll(step[1].str()) <= after) continue;
    if (entry.is_symlink(ec) || !entry.is_directory(ec)) continue;
    if (!committed.count(name)) names.push_back(name);  // it would block its step's save
  }
  std::sort(names.begin(), names.end());
  return names;
}

std::string advice_if_damaged(const fs::path& checkpoint) {
  try {
    mixprec::checkpoint::verify_checkpoint(checkpoint);
    return {};
  } catch (const mixprec::checkpoint::FormatError&) {
    return "; to resume from the newest checkpoint that verifies, delete " +
           (checkpoint.parent_path() / "latest").string();
  }
}

nlohmann::json read_user_metadata(const fs::path& checkpoint) {
  try {
    // Asking for one small tensor reads the manifest and common state and nothing else big.
    mixprec::checkpoint::ReadOptions only_rng;
    only_rng.keys = {std::string(keys::kRngCpu)};
    const mixprec::ShardedStateDict state =
        mixprec::checkpoint::read_checkpoint(checkpoint, only_rng);
    const auto& common = state.common;
    const std::string user_key(keys::kCommonUser);
    if (!common.contains(user_key) || !common.at(user_key).is_object()) {
      throw UsageError("checkpoint " + checkpoint.string() +
                       " was not written by mixprec-train (no user metadata)");
    }
    return common.at(user_key);
  } catch (const mixprec::checkpoint::FormatError& e) {
    throw UsageError("cannot read checkpoint " + checkpoint.string() + ": " + e.what());
  } catch (const c10::Error& e) {
    throw UsageError("cannot read checkpoint " + checkpoint.string() + ": " +
                     e.what_without_backtrace());
  }
}

void ensure_writable_dir(const fs::path& dir, const std::string& what) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) throw UsageError("cannot create " + what + " " + dir.string() + ": " + ec.message());
  if (!fs::is_directory(dir, ec))
    throw UsageError(what + " " + dir.string() + " is not a directory");
  // access(2) answers "yes" to root on read-only directories and says nothing about read-only
  // mounts; creating a file is the only honest test.
  // Ranks on several machines may probe one shared directory at once.
  const fs::path probe = dir / (".mixprec-train-probe-" + unique_suffix());
  const int fd = ::open(probe.c_str(), O_CREAT | O_EXCL | O_WRONLY, 0600);
  if (fd < 0) {
    throw UsageError(what + " " + dir.string() + " is not writable: " + std::strerror(errno));
  }
  // A few bytes, not just a name: a full disk still creates empty files.
  constexpr char kBytes[] = "mixprec-train\n";
  const bool written = ::write(fd, kBytes, sizeof kBytes - 1) == sizeof kBytes - 1;
  const int write_errno = errno;
  ::close(fd);
  ::unlink(probe.c_str());
  if (!written) {
    throw UsageError(what + " " + dir.string() + " is not writable: " + std::strerror(write_errno));
  }
}

bool held_by_another_run(const fs::path& dir) {
  const fs::path file = dir / std::string(mixprec::checkpoint::kRunLockFileName);
  const int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) return false;  // never locked (or not a directory yet)
  // A shared lock conflicts with a holder's exclusive one; taken, it is released at once.
  const bool held = ::flock(fd, LOCK_SH | LOCK_NB) != 0 && errno == EWOULDBLOCK;
  ::close(fd);
  return held;
}

RunLock::RunLock(const fs::path& dir, const std::string& lock_name, const std::string& what,
                 std::chrono::milliseconds wait) {
  try {
    held_ = std::make_unique<mixprec::checkpoint::RootFileLock>(
        mixprec::checkpoint::open_root(dir, /*create=*/true), lock_name, wait, kBusyReason);
  } catch (const mixprec::checkpoint::FormatError& e) {
    const std::string message = e.what();
    if (message.find(kBusyReason) == std::string::npos) {
      throw UsageError("cannot lock " + what + " " + dir.string() + " for this run: " + message);
    }
    throw Busy(what + " " + dir.string() + " is in use: " + message +
               " (one run per directory; --wait-for-ckpt-dir S waits)");
  }
}

RunLock::~RunLock() = default;

std::unique_ptr<RunLock> hold_run_dir(const fs::path& dir, const std::string& lock_name,
                                      const std::string& what, std::chrono::seconds wait,
                                      mixprec::distributed::Communicator* ranks) {
  using Clock = std::chrono::steady_clock;
  const Clock::time_point deadline = Clock::now() + wait;
  const bool several = ranks != nullptr && ranks->size() > 1;
  const bool leader = ranks == nullptr || ranks->rank() == 0;
  // The other ranks wait for rank 0 in a collective, which would time out on a long wait: rank
  // 0 waits in slices well inside the collective timeout and tells them after each one whether
  // it holds the lock, gave up (its error), or waits on.
  const auto slice = several ? std::chrono::milliseconds(5000)
                             : std::chrono::duration_cast<std::chrono::milliseconds>(wait);
  std::unique_ptr<RunLock> lock;
  for (;;) {
    std::string outcome;  // empty: held
    if (leader) {
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      try {
        lock = std::make_unique<RunLock>(dir, lock_name, what,
                                         std::clamp(left, std::chrono::milliseconds(0), slice));
      } catch (const RunLock::Busy& e) {
        outcome = several && Clock::now() < deadline ? kStillWaiting : e.what();
      } catch (const UsageError& e) {
        outcome = e.what();
      }
    }
    if (several) outcome = ranks->all_gather_strings(outcome).front();
    if (outcome.empty()) return lock;
    if (outcome != kStillWaiting) throw UsageError(outcome);
  }
}

void set_aside_unverified(const fs::path& root, const std::vector<std::string>& names,
                          mixprec::distributed::Communicator* ranks,
                          std::vector<std::string>* report) {
  const bool several = ranks != nullptr && ranks->size() > 1;
  // Every rank has looked at them (find_resume_point) before rank 0 moves them.
  if (several) (void)ranks->all_gather_strings("");
  on_every_rank_or_none(ranks, [&] {
    if (ranks != nullptr && ranks->rank() != 0) return;
    for (const std::string& name : names) {
      // A name starting with '.' is never a checkpoint: retention and lookups leave it alone.
      const std::string aside = ".unverified-" + name + "-" + unique_suffix();
      std::error_code ec;
      fs::rename(root / name, root / aside, ec);
      if (ec) {
        throw UsageError("cannot set aside " + (root / name).string() +
                         ", which does not verify, before the run saves its step again: " +
                         ec.message() + " (move it out of " + root.string() + ")");
      }
      if (report != nullptr) report->push_back(name + " -> " + aside);
    }
  });
}

void check_shared_root(const fs::path& root, mixprec::distributed::Communicator& ranks) {
  // Rank 0 writes a token only this run can know; every rank must read it back. A token it
  // cannot write (a full disk) is that error on every rank, not a directory they cannot see.
  std::string token;
  on_every_rank_or_none(&ranks, [&] {
    if (ranks.rank() != 0) return;
    token = ".mixprec-train-shared-" + unique_suffix();
    std::ofstream out(root / token);
    out << token << "\n";
    out.close();
    if (out) return;
    const std::string why = std::strerror(errno);
    std::error_code ec;
    fs::remove(root / token, ec);
    throw UsageError("cannot write to the checkpoint directory " + fs::absolute(root).string() +
                     ": " + why);
  });
  token = ranks.all_gather_strings(token).front();
  std::string seen;
  std::ifstream(root / token) >> seen;
  const bool ok = seen == token;
  const std::vector<std::string> answers =
      ranks.all_gather_strings(ok ? std::string() : host_name());
  if (ranks.rank() == 0) {
    std::error_code ec;
    fs::remove(root / token, ec);
  }
  for (size_t r = 0; r < answers.size(); ++r) {
    if (answers[r].empty()) continue;
    throw UsageError("rank " + std::to_string(r) + " on host " + answers[r] +
                     " does not see the checkpoint directory " + fs::absolute(root).string() +
                     " that rank 0 writes: every rank needs it on a shared filesystem (an absolute "
                     "--out or --ckpt-dir on storage every machine mounts)");
  }
}

Checkpointer::Checkpointer(fs::path root, const CheckpointerOptions& options,
                           std::shared_ptr<mixprec::distributed::Communicator> ranks)
    : root_(std::move(root)), options_(options), ranks_(std::move(ranks)) {
  if (!options_.async) return;
  mixprec::checkpoint::AsyncSaveOptions async;
  async.staging_budget_bytes(options_.staging_budget_bytes);
  async_ = std::make_unique<mixprec::checkpoint::AsyncCheckpointSaver>(async);
  if (ranks_ && ranks_->size() > 1) {
    // The save's collectives on a group of their own: they never interleave with training's,
    // and rank 0 may wait for the root's lock or clean stale staging within their timeout.
    mixprec::distributed::InitOptions group;
    group.timeout = options_.collective_timeout;
    group.group_name = "checkpoint";
    checkpoint_ranks_ = mixprec::distributed::init_from_env(group);
  }
}

void Checkpointer::prepare(std::size_t bytes) {
  if (!async_) return;
  on_every_rank_or_none(ranks_.get(), [&] {
    try {
      async_->reserve(bytes);
    } catch (const c10::Error&) {
      throw UsageError("--async-save needs " + std::to_string((bytes + (1 << 20) - 1) >> 20) +
                       " MiB of host memory to copy the training state into; --staging-budget-mb "
                       "is " +
                       std::to_string(options_.staging_budget_bytes >> 20) +
                       " (raise it, or save synchronously)");
    }
  });
}

namespace {

// A save that fails (a full disk, a file that cannot be written) is a failure of the run — exit
// status 1 — not bad input: the format layer reports both kinds as FormatError, which main()
// takes for bad input (status 2), so the same failure would end a run with a status that
// depends on which saver met it.
template <typename Save>
void failures_of_the_run(Save&& save) {
  try {
    save();
  } catch (const mixprec::checkpoint::FormatError& e) {
    throw std::runtime_error(e.what());
  }
}

}  // namespace

void Checkpointer::save(int64_t step, mixprec::ShardedStateDict state) {
  failures_of_the_run([&] { save_now(step, std::move(state)); });
}

void Checkpointer::save_now(int64_t step, mixprec::ShardedStateDict state) {
  mixprec::checkpoint::SaveOptions options;
  options.keep_last(static_cast<std::size_t>(options_.keep_last));
  const std::string name = checkpoint_name(step);
  const auto start = std::chrono::steady_clock::now();
  if (async_ && async_->in_flight()) wait_for_previous_save(step);
  if (async_ && checkpoint_ranks_) {
    report(mixprec::distributed::save_checkpoint_async(*async_, checkpoint_ranks_, root_, name,
                                                       std::move(state), options));
  } else if (async_) {
    report(async_->save(root_, name, std::move(state), options));
  } else if (ranks_) {
    report(mixprec::distributed::save_checkpoint(*ranks_, root_, name, state, options));
  } else {
    report(mixprec::checkpoint::save_checkpoint(root_, name, state, options));
  }
  stats_.last_blocked_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  stats_.blocked_s += stats_.last_blocked_s;
  stats_.saves += 1;
  stats_.last_dir = root_ / name;
}

// At most one save in flight: the next one waits for it (as save() would), timed here so that
// a cadence shorter than a background save is seen, not just paid.
void Checkpointer::wait_for_previous_save(int64_t step) {
  const auto start = std::chrono::steady_clock::now();
  failures_of_the_run([&] { report(async_->wait()); });
  const double waited =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  // A save that finished has only its thread left to join: microseconds.
  if (waited < 1e-3) return;
  stats_.waited_for_previous += 1;
  stats_.waited_for_previous_s += waited;
  if (stats_.waited_for_previous == 1 && (!ranks_ || ranks_->rank() == 0)) {
    std::fprintf(stderr,
                 "mixprec-train: note: step %lld's checkpoint waited %.3f s for the previous one, "
                 "still being written in the background: a background save takes longer than "
                 "the steps between saves here (the summary counts such waits)\n",
                 static_cast<long long>(step), waited);
  }
}

// The checkpoint is committed and durable: the run goes on, but its user must hear that, say,
// `latest` was not updated or retention could not delete old checkpoints (a disk filling up).
void Checkpointer::report(const std::optional<mixprec::checkpoint::SaveResult>& result) {
  // On several ranks every rank gets rank 0's result, the one that committed.
  if (!result || (ranks_ && ranks_->rank() != 0)) return;
  for (const std::string& warning : result->warnings) {
    std::fprintf(stderr, "mixprec-train: warning: checkpoint %s: %s\n", result->dir.c_str(),
                 warning.c_str());
  }
  stats_.warnings += static_cast<int64_t>(result->warnings.size());
}

void Checkpointer::before_state_changes() {
  if (!async_ || !async_->in_flight()) return;
  const auto start = std::chrono::steady_clock::now();
  failures_of_the_run([&] { async_->wait_until_staged(); });
  const double waited =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  stats_.last_blocked_s += waited;
  stats_.blocked_s += waited;
}

void Checkpointer::finish() {
  if (!async_) return;
  const auto start = std::chrono::steady_clock::now();
  failures_of_the_run([&] { report(async_->wait()); });
  stats_.end_wait_s +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

uint64_t directory_bytes(const fs::path& dir) {
  uint64_t total = 0;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    if (entry.is_regular_file(ec)) total += entry.file_size(ec);
  }
  return total;
}

}  // namespace train
