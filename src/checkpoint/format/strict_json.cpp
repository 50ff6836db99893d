#include "strict_json.h"

#include "fail.h"

#include <algorithm>
#include <optional>
#include <set>

namespace mixprec::checkpoint::detail {
namespace {

using nlohmann::json;

// Tracks the members seen in each open object to reject duplicates, and the path to name
// where it happened. nlohmann reports object starts and keys through this callback before it
// merges a duplicate, which is the only point where the duplicate is still observable.
class DuplicateChecker {
 public:
  DuplicateChecker(std::string_view source, int max_depth)
      : source_(source), max_depth_(max_depth) {}

  bool operator()(int /*depth*/, json::parse_event_t event, json& parsed) {
    switch (event) {
      case json::parse_event_t::object_start:
      case json::parse_event_t::array_start:
        if (static_cast<int>(frames_.size()) >= max_depth_) {
          fail(source_, ": JSON nested deeper than ", max_depth_, " levels at ", path());
        }
        frames_.push_back(Frame{event == json::parse_event_t::object_start, {}, {}});
        break;
      case json::parse_event_t::object_end:
      case json::parse_event_t::array_end:
        frames_.pop_back();
        break;
      case json::parse_event_t::key: {
        Frame& frame = frames_.back();
        const std::string& name = parsed.get_ref<const std::string&>();
        if (!frame.seen.insert(name).second) {
          fail(source_, ": duplicate member '", name, "' in the JSON object at ", path());
        }
        frame.current_key = name;
        break;
      }
      case json::parse_event_t::value:
        break;
    }
    return true;
  }

 private:
  struct Frame {
    bool is_object;
    std::set<std::string> seen;
    std::string current_key;
  };

  // "/a/b" style location of the object being parsed (array elements are shown as "[]").
  std::string path() const {
    std::string out;
    for (std::size_t i = 0; i + 1 < frames_.size(); ++i) {
      out += frames_[i].is_object ? "/" + frames_[i].current_key : "/[]";
    }
    return out.empty() ? "/" : out;
  }

  std::string_view source_;
  int max_depth_;
  std::vector<Frame> frames_;
};

std::string describe(const json& value) {
  switch (value.type()) {
    case json::value_t::null:
      return "null";
    case json::value_t::object:
      return "an object";
    case json::value_t::array:
      return "an array";
    case json::value_t::string:
      return "a string";
    case json::value_t::boolean:
      return "a boolean";
    case json::value_t::number_integer:
      return "a negative integer";
    case json::value_t::number_unsigned:
      return "an unsigned integer";
    case json::value_t::number_float:
      return "a non-integer number";
    default:
      return "an unsupported value";
  }
}

}  // namespace

json parse_json_strict(std::string_view text, std::string_view source, int max_depth) {
  // nlohmann stops at a NUL byte as if the input ended there, which would let anything after
  // it through unchecked. Valid JSON never contains a raw NUL (strings must escape it).
  if (std::size_t nul = text.find('\0'); nul != std::string_view::npos) {
    fail(source, ": invalid JSON: NUL byte at offset ", nul, " of the JSON text");
  }
  try {
    return json::parse(text.begin(), text.end(), DuplicateChecker(source, max_depth));
  } catch (const json::exception& e) {
    // parse_error for syntax, out_of_range for numbers beyond double (e.g. 1e400).
    fail(source, ": invalid JSON: ", e.what());
  }
}

void check_members(const json& value, std::string_view context,
                   std::initializer_list<std::string_view> required,
                   std::initializer_list<std::string_view> optional) {
  if (!value.is_object()) fail(context, ": expected a JSON object, found ", describe(value));
  for (std::string_view name : required) {
    if (!value.contains(name)) fail(context, ": missing field '", name, "'");
  }
  for (auto it = value.begin(); it != value.end(); ++it) {
    const std::string& name = it.key();
    auto matches = [&](std::string_view allowed) { return allowed == name; };
    if (std::none_of(required.begin(), required.end(), matches) &&
        std::none_of(optional.begin(), optional.end(), matches)) {
      fail(context, ": unknown field '", name, "'");
    }
  }
}

const json& field(const json& obj, std::string_view name, std::string_view context) {
  auto it = obj.find(name);
  if (it == obj.end()) fail(context, ": missing field '", name, "'");
  return *it;
}

std::string string_field(const json& obj, std::string_view name, std::string_view context) {
  const json& value = field(obj, name, context);
  if (!value.is_string()) {
    fail(context, ": field '", name, "': expected a string, found ", describe(value));
  }
  return value.get<std::string>();
}

std::uint64_t u64_field(const json& obj, std::string_view name, std::string_view context) {
  const json& value = field(obj, name, context);
  if (!value.is_number_unsigned()) {
    fail(context, ": field '", name, "': expected an unsigned integer, found ", describe(value));
  }
  return value.get<std::uint64_t>();
}

Dtype dtype_field(const json& obj, std::string_view name, std::string_view context) {
  const std::string text = string_field(obj, name, context);
  const std::optional<Dtype> parsed = parse_dtype(text);
  if (!parsed) fail(context, ": field '", name, "': unknown dtype '", text, "'");
  return *parsed;
}

std::vector<std::int64_t> dims_field(const json& obj, std::string_view name,
                                     std::string_view context) {
  const json& value = field(obj, name, context);
  if (!value.is_array()) {
    fail(context, ": field '", name, "': expected an array of integers, found ", describe(value));
  }
  std::vector<std::int64_t> dims;
  dims.reserve(value.size());
  for (std::size_t i = 0; i < value.size(); ++i) {
    const json& d = value[i];
    if (!d.is_number_unsigned() || d.get<std::uint64_t>() > static_cast<std::uint64_t>(INT64_MAX)) {
      fail(context, ": field '", name, "'[", i, "]: expected an integer in [0, 2^63), found ",
           d.is_number_unsigned() ? "a value ≥ 2^63" : describe(d));
    }
    dims.push_back(static_cast<std::int64_t>(d.get<std::uint64_t>()));
  }
  return dims;
}

std::string dump_json(const json& value, int indent, std::string_view context) {
  try {
    return value.dump(indent);
  } catch (const json::type_error& e) {
    fail(context, ": cannot encode as JSON (names must be valid UTF-8): ", e.what());
  }
}

}  // namespace mixprec::checkpoint::detail
