// What every mixprec-ckpt command shares: exit statuses, the error type that carries one, and
// turning a command-line argument into a checkpoint directory.
//
// The tool's contract with scripts: a failure is exactly one line on stderr starting with
// "mixprec-ckpt: " and naming the file or key at fault, plus a non-zero exit status; nothing
// else is printed on stdout for a failed command. So a command does not print as it goes: its
// report and its notes (Notes) are printed once it has succeeded.
#pragma once

#include <filesystem>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace mixprec::tools {

// Exit statuses, documented in `mixprec-ckpt --help`.
inline constexpr int kExitOk = 0;      // success; diff: identical
inline constexpr int kExitFailed = 1;  // verify: corrupt or malformed; diff: different
inline constexpr int kExitUsage = 2;   // bad arguments, unreadable path or file

// A failure the tool reports as "mixprec-ckpt: <message>" before exiting with `code`.
class ToolError : public std::runtime_error {
 public:
  ToolError(int code, const std::string& message) : std::runtime_error(message), code_(code) {}
  int code() const { return code_; }

 private:
  int code_;
};

// What a command has to say besides its report, each printed as a line "mixprec-ckpt: note:
// <note>" on stderr once the command has succeeded (never before a failure's one line).
using Notes = std::vector<std::string>;

// A command-line argument resolved to a checkpoint directory.
struct CheckpointArg {
  std::filesystem::path dir;  // holds manifest.json
  // The argument named a checkpoint root, and `dir` is the checkpoint a load of it takes.
  bool from_root = false;
  // Checkpoints of that root newer than `dir`, passed over because they do not verify (newest
  // first): `dir` is the newest but these.
  std::vector<std::string> skipped;
};

// The checkpoint directory a command-line argument names (a trailing separator or a link to it
// changes nothing): the directory itself if it holds manifest.json, else, for a checkpoint
// root, the checkpoint loading it would take (checkpoint::find_checkpoint: the newest complete
// one; when that is not what `latest` names, a note added to `notes` says why). Throws
// ToolError(kExitUsage) naming the path if it does not exist, is not a directory, or is neither
// a checkpoint nor a root holding one; ToolError(`damaged_status`) naming each checkpoint and
// why if it is a root whose committed checkpoints all fail verification (and no `latest` names
// one). Reads tensor data only to verify a checkpoint newer than `latest`'s.
CheckpointArg checkpoint_from_arg(const std::string& arg, Notes& notes,
                                  int damaged_status = kExitUsage);

// `message` as a single line: newlines (library messages may list several problems) become
// "; ", other control characters are shown escaped (\r, \t, \xNN: a name from a file or the
// command line is seen as it is), surrounding whitespace is trimmed. Never empty ("unknown
// error" instead).
std::string one_line(std::string_view message);

}  // namespace mixprec::tools
