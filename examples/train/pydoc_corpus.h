// The default corpus: the English text of Python's documentation topics.
//
// Python ships the text of its `help()` topics as pydoc_data/topics.py (~750 KB of Python
// source, ~460 KB of text): one dict of string literals. The project's set-up creates a venv
// whose python has it, so the file is on every machine where mixprec-train was built.
#pragma once

#include <filesystem>
#include <string>

namespace train {

// Where the default corpus lives: asks the project's Python (the venv's, known at build time,
// or MIXPREC_PYTHON / python3 on PATH) for pydoc_data.topics, falling back to the standard
// library folders of the interpreters that venv was made from. Throws UsageError if none has it.
std::filesystem::path default_corpus_path();

// The text of a pydoc_data/topics.py file: its dict's string values, decoded from Python
// literals and joined by blank lines. Returns "" if `source` does not look like that file.
std::string decode_pydoc_topics(const std::string& source);

}  // namespace train
