// Options every kernel-resolving command shares, handled once before the command runs.
#pragma once

#include <string>
#include <vector>

namespace kernmap::cli {

/// Removes every `--mapping FILE` (or `--mapping=FILE`) from args and registers each file as user mappings,
/// in the order given (a later file's (layer, device) entries replace an earlier one's). Returns 0, or 2
/// after printing "kernmap COMMAND: <problem>" to stderr when an option lacks its file or a file has an
/// error.
int apply_mapping_options(const std::string& command, std::vector<std::string>& args);

}  // namespace kernmap::cli
