// Name matching helpers shared by the precision plan and later FQN-keyed code.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace mixprec::detail {

// fnmatch(3) without FNM_PATHNAME: `*` and `?` also match '.', so "*norm*" finds
// "blocks.0.norm.weight".
bool glob_match(const std::string& pattern, const std::string& name);

// Up to `limit` candidates closest to `name` (edit distance, ties broken by order), keeping
// only plausible ones: distance at most a third of the name's length, or the same last
// dotted component. Used to make "no such key" errors actionable.
std::vector<std::string> close_matches(std::string_view name,
                                       const std::vector<std::string>& candidates,
                                       size_t limit = 3);

// "a, b, c" — for error messages.
std::string join(const std::vector<std::string>& items, std::string_view sep = ", ");

// The "collect every problem, then one error" pattern: throws c10::Error
// "<what>:\n  - <problem>\n  - ..." when `problems` is not empty. `what` names the op and
// the object at fault ("[mixprec::Float16Optimizer] cannot load the state").
void check_no_problems(const std::vector<std::string>& problems, std::string_view what);

}  // namespace mixprec::detail
