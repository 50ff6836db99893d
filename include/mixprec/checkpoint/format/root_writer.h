// The one writer of a checkpoint root: lock, cleanup, `latest` repair, commit, retention.
//
// A save runs, in order (each step a crash point, crash_point.h):
//   1. open (creating it if missing) the root and take the writer lock: flock(LOCK_EX) on
//      <root>/lock, held until the RootWriter is destroyed — across staging, sequence
//      allocation, commit, `latest` and retention. A second writer (another process, or
//      another RootWriter in this one) gets a FormatError naming the lock file and its
//      holder, or waits up to WriterOptions::lock_timeout for it. The lock file holds
//      "<host> pid <pid>\n" of the last holder, for that message; it is never deleted.
//   2. remove stale staging (retention.h: clean_stale_staging);
//   3. repair `latest`: if a newer complete checkpoint than the one it names verifies
//      (newest_checkpoint.h) — or it is missing, a link, malformed — point it there;
//   4. stage the new checkpoint (commit.h), write its files, take next_sequence();
//   5. publish(): commit it (rename + root fsync: from here it is durable), point `latest`
//      at it and apply retention. Failures in these last two steps do not undo a durable
//      commit: they come back as warnings, not as an exception.
//
//   RootWriter writer(root);
//   auto staging = writer.stage("step-100");
//   ... write files into staging->directory() ...
//   manifest.sequence = writer.next_sequence();
//   PublishReport report = writer.publish(*staging, {.keep_last = 3});
//
// Readers never take the lock; they see the old or the new state. The lock belongs to the
// open lock file (flock semantics): a child forked while it is held shares it until both
// close it; exec closes it (O_CLOEXEC).
#pragma once

#include "mixprec/checkpoint/format/commit.h"
#include "mixprec/checkpoint/format/directory.h"
#include "mixprec/checkpoint/format/root_lock.h"

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace mixprec::checkpoint {

struct WriterOptions {
  // How long to wait for another writer's lock; 0: fail at once.
  std::chrono::milliseconds lock_timeout{0};
  // Another host's staging younger than this is never removed (retention.h).
  std::chrono::seconds foreign_staging_timeout{3600};
};

// What opening the root found and did (steps 2 and 3).
struct OpenReport {
  std::vector<std::string> cleaned_staging;    // stale staging entries removed
  std::optional<std::string> repaired_latest;  // `latest` now names this (it was stale)
  std::vector<std::string> warnings;           // problems that did not stop the writer
};

struct PublishOptions {
  bool update_latest = true;     // point `latest` at the new checkpoint
  std::size_t keep_last = 0;     // > 0: keep-last-K retention after the commit
  std::set<std::string> in_use;  // names retention must not delete (the new one never is)
};

struct PublishReport {
  std::filesystem::path dir;          // <root>/<name>, committed and durable
  std::vector<std::string> deleted;   // removed by retention
  std::vector<std::string> warnings;  // `latest` or retention failures after the commit
};

class RootWriter {
 public:
  // Steps 1–3. Throws FormatError if the root cannot be created or opened, or the lock is
  // held by another writer (after waiting lock_timeout). Problems of steps 2–3 that leave
  // the root usable are warnings in report().
  explicit RootWriter(const std::filesystem::path& root, const WriterOptions& options = {});
  ~RootWriter();  // releases the lock
  RootWriter(const RootWriter&) = delete;
  RootWriter& operator=(const RootWriter&) = delete;

  const Directory& root() const { return root_; }
  const OpenReport& report() const { return report_; }

  // Stages checkpoint `name`. Throws FormatError for an invalid or reserved name, or if
  // <root>/<name> exists. A complete checkpoint is never overwritten: if it is committed
  // (e.g. by a save that crashed before updating `latest`, which step 3 has re-pointed at
  // it), the message says so — resume from it, or save under another name.
  std::unique_ptr<CheckpointStaging> stage(const std::string& name);

  // The sequence the staged checkpoint's manifest must carry (retention.h).
  std::uint64_t next_sequence() const;

  // Step 5. Throws FormatError if the commit itself fails (then nothing was published).
  PublishReport publish(CheckpointStaging& staging, const PublishOptions& options = {});

 private:
  void repair_latest();

  Directory root_;
  std::unique_ptr<RootFileLock> lock_;
  OpenReport report_;
};

}  // namespace mixprec::checkpoint
