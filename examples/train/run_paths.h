// Where a run keeps its files, and which checkpoint a --resume continues from.
//
// A fresh run gets a new directory, runs/<date>-<time>/ (or --out DIR), holding checkpoints/
// and metrics.jsonl; --ckpt-dir and --metrics place those elsewhere. A fresh run never writes
// into a checkpoint root that already holds checkpoints: that is the job of --resume, which
// continues the root's newest complete checkpoint, whatever `latest` says (by default the
// newest run under runs/ that has one).
#pragma once

#include "config.h"

#include <filesystem>
#include <optional>
#include <string>
#include <vector>

namespace train {

struct RunPaths {
  std::filesystem::path ckpt_root;
  std::filesystem::path metrics;
  std::optional<std::filesystem::path> resume_from;  // the checkpoint to load (with --resume)
  std::string resume_note;  // why that is not what `latest` names (a save ended early); or ""
  // Newer checkpoints than resume_from that do not verify (set_aside_unverified moves them).
  std::vector<std::string> unverified;
};

// runs/<date>-<time> (with a suffix if taken): a fresh run's directory unless --out is given.
std::filesystem::path new_run_dir();

// Decides the paths without writing anything; with --resume, the run to continue (by default
// the newest under runs/). Throws UsageError for --resume without a checkpoint directory.
RunPaths resolve_run_paths(const TrainConfig& config);

// What the checkpoint root holds decides how the run starts; call it holding the run lock
// (hold_run_dir), so that a run that waited for another sees that run's checkpoints.
// With --resume: the newest complete checkpoint into `paths.resume_from`, its saved
// configuration into `config` (adopt_run_shape) and its metrics path unless --out, --ckpt-dir
// or --metrics says where this run lives (a copy resumed elsewhere writes its own metrics). Throws
// UsageError: --resume without a checkpoint; a fresh run into a root with checkpoints; a checkpoint
// of another configuration (naming the flag).
void find_resume_point(TrainConfig& config, RunPaths& paths);

}  // namespace train
