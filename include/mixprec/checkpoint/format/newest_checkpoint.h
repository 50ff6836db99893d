// Which checkpoint of a root is the newest complete one, whatever `latest` says.
//
// A crash (or a failed `latest` update) between the commit rename and the `latest` update
// leaves a complete checkpoint that `latest` does not name (commit.h). Resuming from `latest`
// would then go back to an older one and lose that progress. find_newest_checkpoint looks
// past `latest`: among the committed checkpoints (retention.h) with a higher sequence than
// the one `latest` names, the newest that passes verify_checkpoint (verify.h) wins; if none
// does, `latest`'s own checkpoint stands. Verifying reads those candidates completely, which
// costs nothing in the usual case (`latest` names the newest, so there are no candidates).
//
// Readers use it without writing anything (load.h: a load of a root takes the newest and says
// so); the root's writer uses it to repair `latest` (root_writer.h).
#pragma once

#include "mixprec/checkpoint/format/directory.h"

#include <optional>
#include <string>
#include <vector>

namespace mixprec::checkpoint {

struct NewestCheckpoint {
  // The checkpoint to use; nullopt when the root holds none (and no usable `latest`).
  std::optional<std::string> name;
  // What `latest` names; nullopt when there is no `latest` or it is unusable.
  std::optional<std::string> recorded;
  // Why `latest` is unusable (a link, a FIFO, a malformed name, …); empty if it is fine or
  // absent. Readers must refuse such a root (read_latest's error); a writer replaces it.
  std::string latest_error;
  // Newer checkpoints than `recorded` that failed verification, newest first.
  struct Skipped {
    std::string name;
    std::string error;  // verify_checkpoint's
  };
  std::vector<Skipped> skipped;

  // `latest` does not name `name` (stale, missing or unusable): the writer should repair it.
  bool latest_is_stale() const { return name.has_value() && name != recorded; }
  // For a reader that takes `name`: why it is not what `latest` names, and which newer
  // checkpoints it passed over ("" when `latest` names it and nothing was skipped).
  std::string note() const;
};

// Looks at <root> as described above. Never writes. Throws FormatError only if the root
// itself cannot be opened or listed.
NewestCheckpoint find_newest_checkpoint(const Directory& root);

}  // namespace mixprec::checkpoint
