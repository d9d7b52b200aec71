// `kernmap lock DIR`: pins every package of a kernel repository in DIR/kernmap.lock.
#include <CLI/CLI.hpp>

#include <cstdio>
#include <memory>
#include <string>

#include "cli/commands.h"
#include "kernmap/plugins.h"

namespace kernmap::cli {

Command add_lock_command(CLI::App& parent) {
  CLI::App* app = parent.add_subcommand(
      "lock",
      "write DIR/kernmap.lock pinning each package of the kernel repository DIR (name, version, sha256 of "
      "each library)");
  auto dir = std::make_shared<std::string>();
  app->add_option("DIR", *dir, "the kernel repository folder")->type_name("")->required();
  auto run = [dir] {
    const std::string text = write_lock(*dir);
    std::printf("wrote %s/kernmap.lock:\n%s", dir->c_str(), text.c_str());
    return 0;
  };
  return {app, [] {}, run};
}

}  // namespace kernmap::cli
