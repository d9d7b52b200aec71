// Plain-text tables for the command-line tool's output.
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

/// The names with sep between them ("a, b, c").
std::string join(const std::vector<std::string>& names, const char* sep = ", ");
/// A number formatted with `digits` decimals.
std::string fixed(double v, int digits);

}  // namespace kernmap::cli
