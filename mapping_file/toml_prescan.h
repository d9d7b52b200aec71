// What TOML text must pass before toml++ 3.3 (Debian's) parses it: guards against the inputs that exhaust
// its stack or reach its undefined behaviour. Everything refused here is invalid TOML, deeper than mapping
// files may nest, or (one construct, named in the message) valid TOML that toml++ 3.3 misreads.
#pragma once

#include <string>
#include <string_view>

namespace kernmap::mapping_file {

/// At most this many dots outside strings and comments on one line: a dotted key or table header of N parts
/// makes N levels, which toml++ recurses through while it parses and frees a document, and keys cannot span
/// lines. Far above what a mapping file within kMaxDepth needs, far below what exhausts the stack.
constexpr int kMaxLineDots = 64;

/// Throws Error "NAME:LINE:COL: problem" for the first of: a line with more than kMaxLineDots dots outside
/// strings and comments; a character other than ASCII outside strings and comments, right after a backslash
/// in a multi-line string, or first where a line-ending backslash's string goes on (toml++ 3.3 classifies it
/// with a whitespace test that is undefined for most such characters: marzer/tomlplusplus#190, #295).
void prescan_toml(std::string_view text, const std::string& name);

}  // namespace kernmap::mapping_file
