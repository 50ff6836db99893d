#include "ckpt/verify.h"

#include "ckpt/cli.h"
#include "ckpt/text_table.h"

#include "mixprec/checkpoint/format/error.h"
#include "mixprec/checkpoint/format/verify.h"

namespace mixprec::tools {

int run_verify(const std::filesystem::path& dir, std::ostream& out) {
  checkpoint::VerifyReport report;
  try {
    report = checkpoint::verify_checkpoint(dir);
  } catch (const checkpoint::UnsupportedVersionError& e) {
    // Not known to be damaged: only too new to check here.
    throw ToolError(kExitUsage, std::string("cannot verify: ") + e.what());
  } catch (const checkpoint::FormatError& e) {
    // The path was a checkpoint (the caller resolved it), so anything the format layer
    // rejects — a checksum, a truncated file, a missing data file — means it is not intact:
    // status 1, distinct from the usage status 2 of a path that is no checkpoint at all.
    throw ToolError(kExitFailed, std::string("verify failed: ") + e.what());
  }
  out << "OK " << dir.string() << ": " << report.keys << " keys, " << report.chunks << " chunks, "
      << report.files << " files, " << report.bytes << " bytes (" << human_bytes(report.bytes)
      << ") verified\n";
  return kExitOk;
}

}  // namespace mixprec::tools
