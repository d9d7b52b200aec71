// `kernmap lock DIR`: pins every package of a kernel repository in DIR/kernmap.lock.
#include <cstdio>
#include <stdexcept>
#include <string>

#include "cli/commands.h"
#include "kernmap/plugins.h"

namespace kernmap::cli {

int lock_command(const std::vector<std::string>& args) {
  if (args.size() != 1 || args[0].empty() || args[0][0] == '-') {
    throw std::invalid_argument(
        "expected exactly one argument, the repository folder (kernmap lock DIR), got " +
        std::to_string(args.size()) + (args.empty() ? "" : " starting with '" + args[0] + "'"));
  }
  const std::string text = write_lock(args[0]);
  std::printf("wrote %s/kernmap.lock:\n%s", args[0].c_str(), text.c_str());
  return 0;
}

}  // namespace kernmap::cli
