// `mixprec-ckpt inspect DIR`: what a checkpoint holds, and how the optimizer held each
// parameter — the question a mixed-precision checkpoint raises first ("which params have FP32
// masters, which are native FP32, which are frozen?").
//
// Output, in order (plain text, see text_table.h):
//   header     checkpoint path (and, when a root was named, which of its checkpoints this is:
//              the newest, or the newest but those that do not verify), format and version,
//              sequence, files with sizes, optimizer algorithm and step, loss-scaler state,
//              per-group hyper-parameters, user keys;
//   tensors    one row per key: dtype, global shape, bytes, number of chunks;
//   parameters one row per parameter of the optimizer's param groups: role (saved_optimizer.h),
//              model dtype, shape, group, step, the optimizer state it has; then totals per
//              role (count, elements, model bytes, optimizer bytes) and warnings for
//              combinations the optimizer never writes (e.g. a BF16 parameter without master);
//   kept fp32  when common["precision"] is there (state_keys.h): each tensor a conversion kept
//              FP32, its dtype and the plan rule that kept it ("mark", "name <fqn>",
//              "pattern <glob>").
// Reads manifest.json and common.json only: no tensor bytes, so it is fast on any size and
// does not verify checksums (that is `verify`).
#pragma once

#include "ckpt/cli.h"

#include <ostream>
#include <string>

namespace mixprec::tools {

// Writes the report for the checkpoint `checkpoint` resolved (its dir holds manifest.json).
// `shown_as` is how the user named it (the root, when `latest` was followed).
// Throws FormatError (unreadable or malformed manifest/common file) or ToolError naming the
// file and field; writes nothing to `out` then.
int run_inspect(const CheckpointArg& checkpoint, const std::string& shown_as, std::ostream& out);

}  // namespace mixprec::tools
