// mixprec-ckpt: inspect, verify, compare and export mixprec checkpoints (SPEC §4, "A
// command-line tool"). This file only parses the command line and maps every failure to the tool's
// contract (ckpt/cli.h): one line "mixprec-ckpt: …" on stderr and exit status 1 or 2, and
// nothing else; a command's notes and report are printed only once it has succeeded. No
// exception escapes main, whatever the input.
#include "ckpt/cli.h"
#include "ckpt/diff.h"
#include "ckpt/export.h"
#include "ckpt/inspect.h"
#include "ckpt/verify.h"

#include "mixprec/checkpoint/format/error.h"

#include <c10/util/Exception.h>

#include <cerrno>
#include <cstring>
#include <iostream>
#include <new>
#include <sstream>
#include <string>
#include <vector>

namespace {

namespace fs = std::filesystem;
using namespace mixprec::tools;

constexpr const char* kUsage = R"(usage: mixprec-ckpt <command> [arguments]

Inspect, verify, compare and export mixprec checkpoints.

commands:
  inspect DIR   format, sequence, step, loss scaler; every key with dtype, shape, bytes and
                chunks; every optimizer parameter with its role (fp32 master, native fp32,
                frozen) and model dtype, with totals per role; which tensors the precision
                plan kept FP32 and by which rule. Reads metadata only (given a root
                whose 'latest' is stale, finding its newest complete checkpoint
                verifies the newer ones: see below).
  verify DIR    reads every byte and checks all checksums against the manifest.
  diff A B      per-key max |A - B| for keys in both, keys only in A or B, dtype/shape
                mismatches, and common-state (step, hyper-parameters...) differences.
                Values are compared bit for bit: +0 and -0, or NaNs with different
                payloads, differ (with a max |A - B| of 0 or nan).
  export CKPT OUT [--dtype bf16|fp16|fp32|keep] [--max-shard-size SIZE] [--force]
                the model alone (no optimizer or RNG state) as safetensors in OUT, a new
                directory: model.safetensors, or shards model-00001-of-0000K.safetensors...
                with model.safetensors.index.json when larger than --max-shard-size
                (default 5GB; also MB, GiB..., or bytes). --dtype converts floating tensors
                (default keep: as stored, FP32-kept tensors stay FP32). The run's
                configuration and step go into each file's metadata. Written beside OUT,
                then renamed: a failed export leaves OUT as it was. --force replaces an
                existing export.
  help          this text (also -h, --help)

DIR, A, B and CKPT are checkpoint directories (holding manifest.json), or links to them, or
checkpoint roots, in which case the checkpoint a load takes is used: the one 'latest' names,
unless a newer one is complete (a save that ended before updating 'latest'; a "note:" line on
stderr says so).

exit status:
  0  success; diff: the checkpoints are identical
  1  verify: the checkpoint is corrupt or malformed (for a root without 'latest': every
     committed checkpoint is); diff: the checkpoints differ
  2  bad arguments, a path that is not a checkpoint, a file that cannot be read, a
     checkpoint of a newer format version than this tool reads, an export that failed, or
     a report that could not be written to standard output
  129, 130, 131, 143
     export interrupted by SIGHUP, SIGINT, SIGQUIT or SIGTERM (OUT left as it was, nothing
     beside it)
)";

struct Command {
  const char* name;
  std::size_t arguments;
  const char* synopsis;
  bool options = false;  // parses its own options and arguments
};

constexpr Command kCommands[] = {{"inspect", 1, "inspect DIR"},
                                 {"verify", 1, "verify DIR"},
                                 {"diff", 2, "diff A B"},
                                 {"export", 2, kExportSynopsis.data(), true}};

bool is_help(const std::string& arg) { return arg == "-h" || arg == "--help" || arg == "help"; }

// Runs the command, its report written to `report` and its notes added to `notes`.
int run(const std::vector<std::string>& args, std::ostream& report, Notes& notes) {
  if (args.empty()) throw ToolError(kExitUsage, "no command given (try 'mixprec-ckpt --help')");
  if (is_help(args[0])) {
    report << kUsage;
    return kExitOk;
  }
  const Command* command = nullptr;
  for (const Command& c : kCommands) {
    if (args[0] == c.name) command = &c;
  }
  if (command == nullptr) {
    throw ToolError(kExitUsage,
                    "unknown command '" + args[0] + "' (commands: inspect, verify, diff, export)");
  }
  for (std::size_t i = 1; i < args.size(); ++i) {
    // "help" alone may be a checkpoint's name: only the flags ask for help after a command.
    if (args[i] == "-h" || args[i] == "--help") {
      report << "usage: mixprec-ckpt " << command->synopsis << "\n\n" << kUsage;
      return kExitOk;
    }
    if (!command->options && args[i].size() > 1 && args[i][0] == '-') {
      throw ToolError(kExitUsage,
                      std::string(command->name) + ": unknown option '" + args[i] + "'");
    }
  }
  const std::string name = command->name;
  if (name == "export") {
    return run_export(parse_export_args({args.begin() + 1, args.end()}), report, notes);
  }
  if (args.size() - 1 != command->arguments) {
    throw ToolError(kExitUsage, std::string(command->name) + ": expected " +
                                    std::to_string(command->arguments) + " argument" +
                                    (command->arguments == 1 ? "" : "s") + ", got " +
                                    std::to_string(args.size() - 1) + " (usage: mixprec-ckpt " +
                                    command->synopsis + ")");
  }
  if (name == "diff") {
    const fs::path a = checkpoint_from_arg(args[1], notes).dir;
    return run_diff(a, checkpoint_from_arg(args[2], notes).dir, report);
  }
  // A root whose checkpoints all fail verification is, to verify, what a damaged checkpoint is.
  if (name == "verify")
    return run_verify(checkpoint_from_arg(args[1], notes, kExitFailed).dir, report);
  return run_inspect(checkpoint_from_arg(args[1], notes), args[1], report);
}

int fail(int code, std::string_view message) {
  std::cout.flush();
  std::cerr << "mixprec-ckpt: " << one_line(message) << std::endl;
  return code;
}

}  // namespace

// The report is the command's result: one that could not be written (a full disk) is a
// failure, not a success with nothing to show. (A closed pipe ends the tool by SIGPIPE first.)
int checked_output(int code) {
  errno = 0;
  std::cout.flush();
  if (std::cout.good()) return code;
  const int err = errno;
  std::cout.clear();
  return fail(kExitUsage, std::string("write error on standard output") +
                              (err != 0 ? std::string(": ") + std::strerror(err) : std::string()));
}

int main(int argc, char** argv) {
  try {
    std::ostringstream report;
    Notes notes;
    const int code = run(std::vector<std::string>(argv + 1, argv + argc), report, notes);
    for (const std::string& note : notes)
      std::cerr << "mixprec-ckpt: note: " << one_line(note) << "\n";
    std::cout << report.str();
    return checked_output(code);
  } catch (const ToolError& e) {
    return fail(e.code(), e.what());
  } catch (const mixprec::checkpoint::FormatError& e) {
    // inspect and diff: a file that cannot be read or parsed (verify maps its own to 1).
    return fail(kExitUsage, e.what());
  } catch (const c10::Error& e) {
    return fail(kExitUsage, e.what_without_backtrace());
  } catch (const std::bad_alloc&) {
    return fail(kExitUsage, "out of memory");
  } catch (const std::exception& e) {
    return fail(kExitUsage, e.what());
  } catch (...) {
    return fail(kExitUsage, "unknown error");
  }
}
