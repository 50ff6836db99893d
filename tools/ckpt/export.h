// `mixprec-ckpt export CKPT OUT`: the model alone as safetensors, for any safetensors reader
// (HuggingFace's layout), in the dtype asked for.
//
// What is exported: every model parameter and buffer under its fully qualified name (tied
// tensors once, under their first name, as the checkpoint holds them), whole — the chunks of a
// checkpoint written by N ranks are put back together by the library's reader, which verifies
// every checksum on the way. Optimizer state ("optimizer.*") and RNG state ("rng.*") are left
// out (checkpoint/format/state_keys.h). The values are the model tensors of the checkpoint,
// not the optimizer's FP32 masters.
//
// Dtype (--dtype): "keep" writes each tensor as stored (BF16 weights, and FP32 for what the
// precision plan kept FP32); "bf16", "fp16" and "fp32" convert every floating tensor (round to
// nearest even, as torch's .to() does); integer and bool tensors always keep their dtype.
//
// Layout of OUT, a directory the export creates:
//   model.safetensors                      everything, when it fits in one shard; else
//   model-00001-of-0000K.safetensors, …    shards of at most --max-shard-size tensor bytes (a
//                                          tensor larger than that gets a shard of its own),
//                                          tensors in name order
//   model.safetensors.index.json           {"metadata": {"total_size": tensor bytes},
//                                           "weight_map": {name: shard file}} (shards only)
// Each file's "__metadata__": "format": "pt", "mixprec.checkpoint" (the checkpoint
// directory's name), "mixprec.dtype" (the --dtype given) and, when the checkpoint has them,
// "mixprec.step", "mixprec.config" (the run's configuration, common["user"]["config"], as
// JSON) and "mixprec.kept_fp32" (common["precision"] as JSON: which tensors the plan kept
// FP32 in training and why — how they were trained, not how this file stores them: with
// --dtype bf16|fp16 they are converted like the rest). The same checkpoint and options always
// give the same bytes.
//
// Never half-written: everything goes into a sibling directory mixprec-export.tmp-<pid>-<hex> (a
// short name: OUT's own may be as long as a name can be), every file and that directory are
// fsynced, and only then is it renamed to OUT (renameat2 RENAME_NOREPLACE;
// with --force over an existing export, RENAME_EXCHANGE, then the old one is removed). Any
// failure before the rename, or SIGHUP, SIGINT, SIGQUIT or SIGTERM (exit status 128 + the
// signal), removes the temporary directory and leaves OUT as it was.
// --force replaces only a directory that holds nothing but export files (the names above), when
// the export starts and again when it is replaced: one that gained another file meanwhile is
// kept beside OUT (mixprec-export.old-<pid>-<hex>), and the report's note says so.
//
// Memory: tensors are read in batches of at most 256 MiB (one tensor at a time if larger)
// and streamed into the files: about the largest batch plus its converted copy.
#pragma once

#include "ckpt/cli.h"

#include "mixprec/checkpoint/format/dtype.h"

#include <cstdint>
#include <optional>
#include <ostream>
#include <string>
#include <string_view>
#include <vector>

namespace mixprec::tools {

struct ExportOptions {
  std::string checkpoint;  // CKPT as given: a checkpoint directory or a root
  std::string out;         // OUT as given
  // The dtype of floating tensors in the files; nullopt: each tensor's stored dtype ("keep").
  std::optional<checkpoint::Dtype> dtype;
  std::string dtype_name = "keep";                // as given, for the metadata and messages
  std::uint64_t max_shard_bytes = 5'000'000'000;  // tensor bytes per shard (HF's default 5GB)
  bool force = false;                             // replace an existing export at OUT
};

// The synopsis, for usage messages.
inline constexpr std::string_view kExportSynopsis =
    "export CKPT OUT [--dtype bf16|fp16|fp32|keep] [--max-shard-size SIZE] [--force]";

// Parses the arguments after "export": CKPT, OUT and the options, in any order ("--dtype bf16"
// or "--dtype=bf16"). Throws ToolError(kExitUsage) naming the argument: a missing or extra
// positional argument, an unknown option, an option without its value, an unknown --dtype
// (naming the value and the allowed ones), a malformed --max-shard-size.
ExportOptions parse_export_args(const std::vector<std::string>& args);

// "5GB" (10^9), "200MB", "64KiB" (2^10), "1.5GiB", "1000" or "1000B": bytes. Units are
// case-insensitive: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB. Throws ToolError(kExitUsage)
// naming `text` unless it is a positive size below 2^63.
std::uint64_t parse_byte_size(std::string_view text);

// Writes the export and a short report (files, sizes, what was converted) to `out`, and adds
// the note of CKPT's resolution, if any, to `notes` (cli.h). Checks everything it can before
// writing anything: OUT first (its parent is a directory; OUT does not exist, or with --force
// is an export), so that a mistake there is not reported only after CKPT's resolution, which
// may verify checkpoints; then that CKPT resolves to a checkpoint with model tensors.
// Throws ToolError(kExitUsage) naming the path or key on any failure; OUT is then as before
// and nothing is printed.
int run_export(const ExportOptions& options, std::ostream& out, Notes& notes);

}  // namespace mixprec::tools
