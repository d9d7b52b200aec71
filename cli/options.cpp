// `--mapping FILE`: user mappings from files, applied before the command resolves any kernel.
#include "cli/options.h"

#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include "kernmap/mapping_file.h"

namespace kernmap::cli {

int apply_mapping_options(const std::string& command, std::vector<std::string>& args) {
  std::vector<std::string> files;
  std::vector<std::string> rest;
  for (std::size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--mapping") {
      if (i + 1 >= args.size() || args[i + 1].empty()) {
        std::fprintf(stderr, "kernmap %s: --mapping needs a file (.json or .toml)\n", command.c_str());
        return 2;
      }
      files.push_back(args[++i]);
    } else if (a.rfind("--mapping=", 0) == 0) {
      files.push_back(a.substr(10));
    } else {
      rest.push_back(a);
    }
  }
  for (const std::string& file : files) {
    try {
      register_mapping_file(file);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "kernmap %s: %s\n", command.c_str(),
                   e.what());  // the message starts with the file
      return 2;
    }
  }
  args = std::move(rest);
  return 0;
}

}  // namespace kernmap::cli
