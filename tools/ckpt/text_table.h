// Plain-text output of mixprec-ckpt: aligned tables and human-readable numbers.
//
// Output is meant for people and for grep: one record per line, columns separated by at
// least two spaces, no colour, no terminal-width detection (piped output looks the same).
#pragma once

#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

namespace mixprec::tools {

// A table whose columns are padded to their widest cell. Columns listed in `right_aligned`
// (by index) are right-aligned (numbers); the rest left-aligned.
class TextTable {
 public:
  TextTable(std::vector<std::string> header, std::vector<std::size_t> right_aligned = {});

  // Rows shorter than the header are padded with empty cells; longer ones are truncated.
  void add_row(std::vector<std::string> row);
  bool empty() const { return rows_.empty(); }

  // Writes the header and the rows, each line prefixed with `indent`.
  void print(std::ostream& out, const std::string& indent = "  ") const;

 private:
  std::vector<std::string> header_;
  std::vector<bool> right_;
  std::vector<std::vector<std::string>> rows_;
};

// "312 B", "4.0 KiB", "1.50 GiB" (binary units; exact byte counts are printed elsewhere).
std::string human_bytes(std::uint64_t bytes);

// "[8, 8]"; "[]" for a scalar.
std::string dims_string(const std::vector<std::int64_t>& dims);

// A number for a table cell: integers as such, others with 6 significant digits ("3.8147e-06",
// "0.25"); "nan" / "inf" spelled out.
std::string format_number(double value);

// `value` as compact JSON, cut to at most `limit` characters ("..." at the end) so that a
// long value (user metadata) stays on one line.
std::string short_json(const nlohmann::json& value, std::size_t limit);

}  // namespace mixprec::tools
