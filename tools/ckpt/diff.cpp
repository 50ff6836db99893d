#include "ckpt/diff.h"

#include "ckpt/cli.h"
#include "ckpt/text_table.h"

#include "mixprec/checkpoint/format/manifest.h"
#include "mixprec/checkpoint/load.h"

#include <ATen/ATen.h>

#include <cmath>
#include <sstream>

namespace mixprec::tools {
namespace {

namespace fs = std::filesystem;
using checkpoint::KeyEntry;
using checkpoint::Manifest;

constexpr std::uint64_t kBatchBytes = std::uint64_t{256} << 20;
constexpr int64_t kSliceElements = int64_t{1} << 22;  // keeps the double temporaries at 32 MiB

struct ValueDiff {
  double max_abs = 0.0;   // over differing elements; NaN if one side is NaN somewhere
  int64_t differing = 0;  // elements whose bits differ
};

c10::ScalarType same_size_integer(int64_t element_size) {
  switch (element_size) {
    case 1:
      return at::kByte;
    case 2:
      return at::kShort;
    case 4:
      return at::kInt;
    default:
      return at::kLong;
  }
}

ValueDiff compare_values(const at::Tensor& a, const at::Tensor& b) {
  ValueDiff out;
  const at::Tensor fa = a.reshape({-1}), fb = b.reshape({-1});
  const c10::ScalarType bits = same_size_integer(a.element_size());
  for (int64_t begin = 0; begin < fa.numel(); begin += kSliceElements) {
    const int64_t n = std::min(kSliceElements, fa.numel() - begin);
    const at::Tensor sa = fa.narrow(0, begin, n), sb = fb.narrow(0, begin, n);
    const at::Tensor differs = sa.view(bits).ne(sb.view(bits));
    const int64_t count = differs.sum().item<int64_t>();
    if (count == 0) continue;
    out.differing += count;
    // Only elements whose bits differ: equal NaNs and equal infinities contribute nothing.
    at::Tensor distance = (sa.to(at::kDouble) - sb.to(at::kDouble)).abs();
    if (at::isIntegralType(sa.scalar_type(), /*includeBool=*/false)) {
      // Integers past 2^53 round alike in double (2^60 and 2^60 + 1 would show 0): exact in
      // int64 wherever the difference is small enough to matter.
      const at::Tensor exact = (sa.to(at::kLong) - sb.to(at::kLong)).abs().to(at::kDouble);
      distance = at::where(distance < 9007199254740992.0, exact, distance);
    }
    const double m = distance.masked_select(differs).max().item<double>();
    if (std::isnan(m) || std::isnan(out.max_abs)) {
      out.max_abs = std::nan("");
    } else {
      out.max_abs = std::max(out.max_abs, m);
    }
  }
  return out;
}

std::string describe(const KeyEntry& entry) {
  return std::string(checkpoint::dtype_name(entry.dtype)) + " " + dims_string(entry.shape);
}

}  // namespace

int run_diff(const fs::path& a, const fs::path& b, std::ostream& out) {
  const Manifest ma = checkpoint::read_manifest(a), mb = checkpoint::read_manifest(b);
  const nlohmann::json ca = checkpoint::read_common(a, ma), cb = checkpoint::read_common(b, mb);

  std::vector<std::string> only_a, only_b, mismatched;
  std::vector<std::vector<std::string>> batches(1);
  std::uint64_t batch_bytes = 0;
  for (const auto& [key, ea] : ma.keys) {
    auto eb = mb.keys.find(key);
    if (eb == mb.keys.end()) {
      only_a.push_back(key + " (" + describe(ea) + ")");
    } else if (ea.dtype != eb->second.dtype || ea.shape != eb->second.shape) {
      mismatched.push_back(key + ": A " + describe(ea) + ", B " + describe(eb->second));
    } else {
      if (!batches.back().empty() && batch_bytes + ea.bytes() > kBatchBytes) {
        batches.emplace_back();
        batch_bytes = 0;
      }
      batches.back().push_back(key);
      batch_bytes += ea.bytes();
    }
  }
  for (const auto& [key, eb] : mb.keys) {
    if (!ma.keys.count(key)) only_b.push_back(key + " (" + describe(eb) + ")");
  }

  TextTable table({"KEY", "DTYPE", "SHAPE", "MAX |A-B|", "DIFFERING"}, {3, 4});
  std::size_t compared = 0, differing_keys = 0;
  for (const auto& batch : batches) {
    if (batch.empty()) continue;
    checkpoint::ReadOptions options;
    options.keys = {batch.begin(), batch.end()};
    const ShardedStateDict sa = checkpoint::read_checkpoint(a, options);
    const ShardedStateDict sb = checkpoint::read_checkpoint(b, options);
    for (const std::string& key : batch) {
      const ValueDiff d = compare_values(sa.at(key).local, sb.at(key).local);
      ++compared;
      differing_keys += d.differing != 0;
      const KeyEntry& entry = ma.keys.at(key);
      table.add_row({key, std::string(checkpoint::dtype_name(entry.dtype)),
                     dims_string(entry.shape), format_number(d.max_abs),
                     std::to_string(d.differing) + "/" + std::to_string(sa.at(key).local.numel())});
    }
  }

  // The common state as JSON: nlohmann's diff yields RFC 6902 operations with JSON pointers.
  const nlohmann::json patch = nlohmann::json::diff(ca, cb);
  std::vector<std::string> common_diffs;
  for (const auto& op : patch) {
    const nlohmann::json::json_pointer ptr(op.at("path").get<std::string>());
    const std::string before = ca.contains(ptr) ? short_json(ca.at(ptr), 80) : "(absent)";
    // An "add" at an array's end has the pointer ".../-", which names no element: its value
    // is in the operation.
    const std::string after = op.contains("value") && op.at("op") == "add"
                                  ? short_json(op.at("value"), 80)
                              : cb.contains(ptr) ? short_json(cb.at(ptr), 80)
                                                 : "(absent)";
    common_diffs.push_back(ptr.to_string() + ": " + before + " -> " + after);
  }

  std::ostringstream text;
  text << "A  " << a.string() << "  (sequence " << ma.sequence << ")\n"
       << "B  " << b.string() << "  (sequence " << mb.sequence << ")\n"
       << "\ntensors in both: " << compared << " compared, " << differing_keys << " differ, "
       << mismatched.size() << " dtype/shape mismatches; " << only_a.size() << " only in A, "
       << only_b.size() << " only in B\n";
  if (!table.empty()) table.print(text);
  for (const auto& m : mismatched) text << "mismatch: " << m << "\n";
  for (const auto& k : only_a) text << "only in A: " << k << "\n";
  for (const auto& k : only_b) text << "only in B: " << k << "\n";
  text << "\ncommon state: " << common_diffs.size() << " difference"
       << (common_diffs.size() == 1 ? "" : "s") << "\n";
  for (const auto& c : common_diffs) text << "  " << c << "\n";

  const bool identical = differing_keys == 0 && mismatched.empty() && only_a.empty() &&
                         only_b.empty() && common_diffs.empty();
  text << "\nresult: " << (identical ? "identical" : "different") << "\n";
  out << text.str();
  return identical ? kExitOk : kExitFailed;
}

}  // namespace mixprec::tools
