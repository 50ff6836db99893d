#include "detail/name_match.h"

#include <c10/util/Exception.h>
#include <fnmatch.h>

#include <algorithm>
#include <numeric>

namespace mixprec::detail {

bool glob_match(const std::string& pattern, const std::string& name) {
  return fnmatch(pattern.c_str(), name.c_str(), 0) == 0;
}

namespace {

size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  std::iota(row.begin(), row.end(), size_t{0});
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t substitute = diagonal + (a[i - 1] == b[j - 1] ? 0 : 1);
      diagonal = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, substitute});
    }
  }
  return row[b.size()];
}

std::string_view last_component(std::string_view name) {
  const auto dot = name.rfind('.');
  return dot == std::string_view::npos ? name : name.substr(dot + 1);
}

}  // namespace

std::vector<std::string> close_matches(std::string_view name,
                                       const std::vector<std::string>& candidates, size_t limit) {
  struct Scored {
    size_t distance;
    size_t index;
  };
  std::vector<Scored> scored;
  const size_t budget = std::max<size_t>(2, name.size() / 3);
  for (size_t i = 0; i < candidates.size(); ++i) {
    const size_t d = edit_distance(name, candidates[i]);
    if (d <= budget || last_component(candidates[i]) == last_component(name)) {
      scored.push_back({d, i});
    }
  }
  std::stable_sort(scored.begin(), scored.end(),
                   [](const Scored& x, const Scored& y) { return x.distance < y.distance; });
  std::vector<std::string> out;
  for (size_t i = 0; i < scored.size() && out.size() < limit; ++i) {
    out.push_back(candidates[scored[i].index]);
  }
  return out;
}

std::string join(const std::vector<std::string>& items, std::string_view sep) {
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) {
    if (i) out += sep;
    out += items[i];
  }
  return out;
}

}  // namespace mixprec::detail

namespace mixprec::detail {

void check_no_problems(const std::vector<std::string>& problems, std::string_view what) {
  if (problems.empty()) return;
  TORCH_CHECK(false, what, ":\n  - ", join(problems, "\n  - "));
}

}  // namespace mixprec::detail
