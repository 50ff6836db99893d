#include "pydoc_corpus.h"

#include "build_paths.h"
#include "config.h"

#include <array>
#include <cctype>
#include <cstdio>
#include <fstream>
#include <memory>
#include <optional>
#include <string_view>
#include <vector>

namespace train {
namespace fs = std::filesystem;

namespace {

std::string shell_quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

// The path pydoc_data.topics has under `python`, or "" if that python does not run.
std::string ask_python(const std::string& python) {
  const std::string command = shell_quote(python) +
                              " -I -c 'import pydoc_data.topics as t; print(t.__file__)'"
                              " 2>/dev/null </dev/null";
  std::unique_ptr<FILE, int (*)(FILE*)> pipe(::popen(command.c_str(), "r"), ::pclose);
  if (!pipe) return "";
  std::string out;
  std::array<char, 512> buffer{};
  while (std::fgets(buffer.data(), buffer.size(), pipe.get()) != nullptr) out += buffer.data();
  while (!out.empty() && (out.back() == '\n' || out.back() == '\r')) out.pop_back();
  return out;
}

// The standard library folders next to an interpreter's bin/ directory.
std::vector<fs::path> stdlib_topics_under(const fs::path& prefix) {
  std::vector<fs::path> found;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(prefix / "lib", ec)) {
    const fs::path candidate = entry.path() / "pydoc_data" / "topics.py";
    if (entry.path().filename().string().starts_with("python3") &&
        fs::is_regular_file(candidate, ec)) {
      found.push_back(candidate);
    }
  }
  return found;
}

// "home = /usr/bin" in <venv>/pyvenv.cfg names the interpreter the venv was made from.
std::optional<fs::path> venv_home(const fs::path& python) {
  std::ifstream cfg(python.parent_path().parent_path() / "pyvenv.cfg");
  for (std::string line; std::getline(cfg, line);) {
    if (line.rfind("home", 0) != 0) continue;
    const size_t eq = line.find('=');
    if (eq == std::string::npos) continue;
    std::string home = line.substr(eq + 1);
    home.erase(0, home.find_first_not_of(" \t"));
    home.erase(home.find_last_not_of(" \t\r") + 1);
    return fs::path(home);
  }
  return std::nullopt;
}

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

// Decodes one Python string literal starting at s[i] (its quote); advances i past it.
// Returns false on a malformed literal.
bool read_literal(const std::string& s, size_t& i, bool raw, std::string& out) {
  const char quote = s[i];
  const bool triple = s.compare(i, 3, std::string(3, quote)) == 0;
  i += triple ? 3 : 1;
  auto hex = [&](size_t digits) -> std::optional<uint32_t> {
    if (i + digits > s.size()) return std::nullopt;
    uint32_t v = 0;
    for (size_t k = 0; k < digits; ++k) {
      const char c = s[i + k];
      const int d = std::isdigit(static_cast<unsigned char>(c)) ? c - '0'
                    : (c >= 'a' && c <= 'f')                    ? c - 'a' + 10
                    : (c >= 'A' && c <= 'F')                    ? c - 'A' + 10
                                                                : -1;
      if (d < 0) return std::nullopt;
      v = v * 16 + static_cast<uint32_t>(d);
    }
    i += digits;
    return v;
  };
  while (i < s.size()) {
    if (triple ? s.compare(i, 3, std::string(3, quote)) == 0 : s[i] == quote) {
      i += triple ? 3 : 1;
      return true;
    }
    if (!triple && s[i] == '\n') return false;
    if (s[i] != '\\') {
      out += s[i++];
      continue;
    }
    if (i + 1 >= s.size()) return false;
    const char e = s[i + 1];
    if (raw) {  // a backslash stays, and keeps the next character from ending the literal
      out += '\\';
      out += e;
      i += 2;
      continue;
    }
    i += 2;
    switch (e) {
      case 'n':
        out += '\n';
        break;
      case 't':
        out += '\t';
        break;
      case 'r':
        out += '\r';
        break;
      case '\\':
        out += '\\';
        break;
      case '\'':
        out += '\'';
        break;
      case '"':
        out += '"';
        break;
      case '\n':
        break;  // line continuation
      case 'x':
        if (auto v = hex(2))
          append_utf8(out, *v);
        else
          return false;
        break;
      case 'u':
        if (auto v = hex(4))
          append_utf8(out, *v);
        else
          return false;
        break;
      case 'U':
        if (auto v = hex(8))
          append_utf8(out, *v);
        else
          return false;
        break;
      default:
        out += '\\';
        out += e;
        break;  // unknown escapes stay as written, as in Python
    }
  }
  return false;
}

}  // namespace

fs::path default_corpus_path() {
  std::vector<std::string> pythons;
  if (const char* env = std::getenv("MIXPREC_PYTHON"); env != nullptr && *env != '\0') {
    pythons.emplace_back(env);
  }
  if (*kBuildPython != '\0') pythons.emplace_back(kBuildPython);
  pythons.emplace_back("python3");
  std::error_code ec;
  for (const std::string& python : pythons) {
    const std::string path = ask_python(python);
    if (!path.empty() && fs::is_regular_file(path, ec)) return path;
  }
  // No python ran: look where the interpreters behind those venvs keep their standard library.
  for (const std::string& python : pythons) {
    if (auto home = venv_home(python)) {
      for (const fs::path& p : stdlib_topics_under(home->parent_path())) return p;
    }
  }
  for (const fs::path& p : stdlib_topics_under("/usr")) return p;
  throw UsageError(
      "no default corpus: no Python with pydoc_data/topics.py was found (set MIXPREC_PYTHON "
      "or run scripts/run-demo once); pass --data FILE to train on a text file");
}

std::string decode_pydoc_topics(const std::string& s) {
  // The file is one dict literal: {'key': 'value' 'continued', ...}. Keys are dropped, values
  // (adjacent literals concatenated, as Python does) are joined by blank lines.
  std::string text, value;
  bool in_value = false;
  int values = 0;
  for (size_t i = 0; i < s.size();) {
    const char c = s[i];
    if (c == '#') {
      i = s.find('\n', i);
      if (i == std::string::npos) break;
      continue;
    }
    bool raw = false;
    size_t quote = i;
    while (quote < s.size() &&
           std::string_view("rRuUbB").find(s[quote]) != std::string_view::npos) {
      raw = raw || s[quote] == 'r' || s[quote] == 'R';
      ++quote;
    }
    if (quote < s.size() && (s[quote] == '\'' || s[quote] == '"') &&
        (quote == i || !std::isalnum(static_cast<unsigned char>(i > 0 ? s[i - 1] : ' ')))) {
      i = quote;
      std::string literal;
      if (!read_literal(s, i, raw, literal)) return "";
      if (in_value) value += literal;
      continue;
    }
    if (c == ':') {
      in_value = true;
    } else if ((c == ',' || c == '}') && in_value) {
      if (!text.empty()) text += "\n\n";
      text += value;
      value.clear();
      in_value = false;
      ++values;
    }
    i = quote == i ? i + 1 : quote;
  }
  return values > 0 ? text : "";
}

}  // namespace train
