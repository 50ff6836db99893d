// Private: one step of a collective operation whose outcome every rank must share.
//
// A collective save or load runs in phases. In each, every rank does its part and then
// learns every other rank's outcome in one all-gather: if any rank failed, every rank throws
// the same error (naming the first failing rank and its message); only if all succeeded does
// any rank go on. A rank whose part throws still takes part in the all-gather, so no rank
// waits for it; a rank that never arrives (it died) makes the all-gather time out on every
// other rank (Communicator's timeout), which throws there too.
#pragma once

#include "mixprec/distributed/communicator.h"

#include <functional>
#include <string>
#include <string_view>
#include <vector>

namespace mixprec::distributed::detail {

// Runs `part` on this rank and agrees on the outcome (see above). Returns every rank's
// payload, in rank order, when `part` returned on every rank. Otherwise throws c10::Error on
// every rank: "[<op>] failed on rank <r> of <n> (<k> rank(s) failed): <its message>". A
// communicator error (timeout, a peer gone) propagates from the all-gather as it is.
std::vector<std::string> agree(Communicator& comm, std::string_view op,
                               const std::function<std::string()>& part);

// Runs `part` on rank `worker` alone, on a thread of its own, and agrees on its outcome as
// agree() does; returns its payload on every rank. The other ranks do not wait for it in one
// collective, which would time the group out when the part takes longer than the
// communicator's timeout (rank 0 verifying a checkpoint newer than `latest` reads every byte of
// it): every quarter of the timeout all ranks agree on whether it has finished. If a collective
// fails meanwhile, the worker's call returns (throws) once the part has finished: the part must
// end by itself.
std::string agree_on_one_ranks_part(Communicator& comm, std::string_view op, int worker,
                                    const std::function<std::string()>& part);

}  // namespace mixprec::distributed::detail
