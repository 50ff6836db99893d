// Strict JSON reading shared by the safetensors header and manifest parsers: duplicate member
// names are errors (nlohmann keeps the last one silently — a header could then describe one
// tensor twice and be read differently by different tools), nesting is bounded, and every
// typed accessor throws FormatError naming the field instead of nlohmann's type_error.
#pragma once

#include "mixprec/checkpoint/format/dtype.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace mixprec::checkpoint::detail {

// Parses `text` as one JSON value. Throws FormatError "<source>: invalid JSON: ..." (with
// nlohmann's byte position), "<source>: duplicate member '<name>' at <json path>", or
// "<source>: JSON nested deeper than <max_depth>".
nlohmann::json parse_json_strict(std::string_view text, std::string_view source, int max_depth);

// `context` below is the prefix that locates the value, e.g. "m.json: key 'w': chunk 0".

// Throws unless `value` is an object whose member names are all in `allowed`
// (and, for `required`, present).
void check_members(const nlohmann::json& value, std::string_view context,
                   std::initializer_list<std::string_view> required,
                   std::initializer_list<std::string_view> optional = {});

// obj[field] as the given type; throws "<context>: field '<field>': expected ..." otherwise.
const nlohmann::json& field(const nlohmann::json& obj, std::string_view name,
                            std::string_view context);
std::string string_field(const nlohmann::json& obj, std::string_view name,
                         std::string_view context);
std::uint64_t u64_field(const nlohmann::json& obj, std::string_view name, std::string_view context);
// A dtype name (dtype.h); throws "<context>: field '<field>': unknown dtype '<name>'" otherwise.
Dtype dtype_field(const nlohmann::json& obj, std::string_view name, std::string_view context);
// An array of integers in [0, 2^63) (a shape or an offset).
std::vector<std::int64_t> dims_field(const nlohmann::json& obj, std::string_view name,
                                     std::string_view context);

// json.dump() with invalid UTF-8 reported as FormatError naming `context`.
std::string dump_json(const nlohmann::json& value, int indent, std::string_view context);

}  // namespace mixprec::checkpoint::detail
