// Plain-text tables and JSON string escaping for the command-line tool's output.
#pragma once

#include <string>
#include <vector>

namespace kernmap::cli {

/// A table printed with aligned columns; cells that look like numbers are right-aligned.
struct Table {
  std::vector<std::string> header;
  std::vector<std::vector<std::string>> rows;
  std::string render() const;
};

/// s as a JSON string literal, quotes included.
std::string json_string(const std::string& s);
/// A number formatted with `digits` decimals.
std::string fixed(double v, int digits);

}  // namespace kernmap::cli
