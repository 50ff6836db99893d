#include "ckpt/text_table.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>

namespace mixprec::tools {

TextTable::TextTable(std::vector<std::string> header, std::vector<std::size_t> right_aligned)
    : header_(std::move(header)), right_(header_.size(), false) {
  for (std::size_t column : right_aligned) {
    if (column < right_.size()) right_[column] = true;
  }
}

void TextTable::add_row(std::vector<std::string> row) {
  row.resize(header_.size());
  rows_.push_back(std::move(row));
}

void TextTable::print(std::ostream& out, const std::string& indent) const {
  std::vector<std::size_t> width(header_.size(), 0);
  auto widen = [&](const std::vector<std::string>& row) {
    for (std::size_t c = 0; c < row.size(); ++c) width[c] = std::max(width[c], row[c].size());
  };
  widen(header_);
  for (const auto& row : rows_) widen(row);

  auto line = [&](const std::vector<std::string>& row) {
    std::string text = indent;
    for (std::size_t c = 0; c < row.size(); ++c) {
      const std::string pad(width[c] - row[c].size(), ' ');
      text += right_[c] ? pad + row[c] : row[c] + (c + 1 < row.size() ? pad : "");
      if (c + 1 < row.size()) text += "  ";
    }
    // Trailing blanks of an empty last cell would only confuse grep and diff.
    text.erase(text.find_last_not_of(' ') + 1);
    out << text << '\n';
  };
  line(header_);
  for (const auto& row : rows_) line(row);
}

std::string human_bytes(std::uint64_t bytes) {
  static constexpr const char* kUnits[] = {"KiB", "MiB", "GiB", "TiB", "PiB"};
  if (bytes < 1024) return std::to_string(bytes) + " B";
  double value = static_cast<double>(bytes);
  int unit = -1;
  while (value >= 1024.0 && unit + 1 < 5) {
    value /= 1024.0;
    ++unit;
  }
  char text[32];
  std::snprintf(text, sizeof text, value < 10 ? "%.2f %s" : "%.1f %s", value, kUnits[unit]);
  return text;
}

std::string dims_string(const std::vector<std::int64_t>& dims) {
  std::string out = "[";
  for (std::size_t i = 0; i < dims.size(); ++i) {
    out += (i ? ", " : "") + std::to_string(dims[i]);
  }
  return out + "]";
}

std::string format_number(double value) {
  if (std::isnan(value)) return "nan";
  if (std::isinf(value)) return value > 0 ? "inf" : "-inf";
  char text[32];
  std::snprintf(text, sizeof text, "%.6g", value);
  return text;
}

std::string short_json(const nlohmann::json& value, std::size_t limit) {
  std::string text = value.dump();
  if (text.size() > limit) text = text.substr(0, limit - 3) + "...";
  return text;
}

}  // namespace mixprec::tools
