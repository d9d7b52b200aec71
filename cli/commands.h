// The `kernmap` subcommands. Each takes the arguments after its name and returns the process exit code.
#pragma once

#include <string>
#include <vector>

namespace kernmap::cli {

/// Loads the plugin packages of KERNMAP_PATH; refusals go to stderr (and `kernmap kernels` shows them all).
void load_env_plugins();

int kernels_command(const std::vector<std::string>& args);
int bench_command(const std::vector<std::string>& args);
int plan_command(const std::vector<std::string>& args);
int train_command(const std::vector<std::string>& args);
int align_command(const std::vector<std::string>& args);
int ablate_command(const std::vector<std::string>& args);
int lock_command(const std::vector<std::string>& args);

}  // namespace kernmap::cli
