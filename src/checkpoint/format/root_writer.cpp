#include "mixprec/checkpoint/format/root_writer.h"

#include "fail.h"
#include "mixprec/checkpoint/format/crash_point.h"
#include "mixprec/checkpoint/format/error.h"
#include "mixprec/checkpoint/format/latest.h"
#include "mixprec/checkpoint/format/manifest.h"
#include "mixprec/checkpoint/format/newest_checkpoint.h"
#include "mixprec/checkpoint/format/retention.h"
#include "mixprec/checkpoint/format/root_layout.h"
#include "mixprec/checkpoint/format/root_lock.h"
#include "posix_file.h"
#include "staging_dirs.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <thread>

namespace mixprec::checkpoint {
namespace {

using detail::concat;
using detail::crash_point;
using detail::fail;

}  // namespace

RootWriter::RootWriter(const std::filesystem::path& root, const WriterOptions& options)
    : root_(open_root(root, /*create=*/true)),
      lock_(std::make_unique<RootFileLock>(
          root_, kLockFileName, options.lock_timeout,
          "another writer holds this checkpoint root's lock; one writer per root")) {
  try {
    report_.cleaned_staging =
        clean_stale_staging(root_, StagingCleanupOptions{options.foreign_staging_timeout});
  } catch (const FormatError& e) {
    report_.warnings.push_back(concat("stale staging was not cleaned: ", e.what()));
  }
  repair_latest();
}

RootWriter::~RootWriter() = default;

void RootWriter::repair_latest() {
  NewestCheckpoint newest;
  try {
    newest = find_newest_checkpoint(root_);
  } catch (const FormatError& e) {
    report_.warnings.push_back(concat("'latest' was not checked: ", e.what()));
    return;
  }
  if (!newest.latest_error.empty()) {
    report_.warnings.push_back(
        concat("'latest' is unusable and will be replaced: ", newest.latest_error));
  }
  for (const NewestCheckpoint::Skipped& skipped : newest.skipped) {
    report_.warnings.push_back(concat(
        "a checkpoint newer than 'latest' does not verify and is left as it is: ", skipped.name,
        ": ", skipped.error));
  }
  if (!newest.latest_is_stale()) return;
  crash_point("repair: before latest");
  try {
    write_latest(root_, *newest.name);
    report_.repaired_latest = newest.name;
  } catch (const FormatError& e) {
    report_.warnings.push_back(concat("'latest' could not be repaired: ", e.what()));
  }
  crash_point("repair: after latest");
}

std::unique_ptr<CheckpointStaging> RootWriter::stage(const std::string& name) {
  check_checkpoint_name(root_.path(), name);
  const std::filesystem::path path = root_ / name;
  if (const auto st = detail::stat_entry(root_.fd(), name, path)) {
    bool committed = false;
    if (S_ISDIR(st->st_mode)) {
      try {
        read_manifest(root_.subdirectory(name));
        committed = true;
      } catch (const FormatError&) {
      }
    }
    if (committed) {
      fail(path.string(), ": checkpoint already exists and is committed",
           report_.repaired_latest == name ? " ('latest' did not name it yet and now does)" : "",
           "; refusing to overwrite a committed checkpoint: resume from it, or save under ",
           "another name");
    }
    fail(path.string(), ": already exists (", detail::file_type_name(st->st_mode),
         ", not a committed checkpoint); refusing to overwrite it");
  }
  return std::make_unique<CheckpointStaging>(root_, name);
}

std::uint64_t RootWriter::next_sequence() const { return checkpoint::next_sequence(root_); }

PublishReport RootWriter::publish(CheckpointStaging& staging, const PublishOptions& options) {
  PublishReport report;
  report.dir = staging.commit(CommitOptions{.update_latest = false});
  const std::string& name = staging.name();
  if (options.update_latest) {
    try {
      write_latest(root_, name);
    } catch (const FormatError& e) {
      report.warnings.push_back(concat(
          "'", name, "' is committed and durable, but 'latest' was not updated (a load of the ",
          "root still finds it; the next save repairs 'latest'): ", e.what()));
    }
  }
  if (options.keep_last > 0) {
    try {
      RetentionOptions retention(options.keep_last, options.in_use);
      retention.in_use.insert(name);
      apply_retention(root_, retention, &report.deleted);
    } catch (const FormatError& e) {
      report.warnings.push_back(
          concat("'", name, "' is committed and durable, but retention stopped: ", e.what()));
    }
  }
  return report;
}

}  // namespace mixprec::checkpoint
