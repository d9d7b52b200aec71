// The JSON documents the command-line tool prints (--json), written by nlohmann-json: numbers round-trip
// (shortest form that reads back to the same double), a non-finite number is written as null, and text that
// is not valid UTF-8 (a path, a message) has the bad bytes replaced by U+FFFD instead of failing the dump.
#pragma once

#include <nlohmann/json.hpp>

namespace kernmap::cli {

/// Keys in the order they are added, as the documents have always been printed.
using Json = nlohmann::ordered_json;

/// doc on stdout, indented by 2, and a newline.
void print_json(const Json& doc);

}  // namespace kernmap::cli
