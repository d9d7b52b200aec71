// The `kernmap` subcommands. Each takes the arguments after its name and returns the process exit code.
#pragma once

#include <string>
#include <vector>

namespace kernmap::cli {

int kernels_command(const std::vector<std::string>& args);
int bench_command(const std::vector<std::string>& args);
int plan_command(const std::vector<std::string>& args);
int train_command(const std::vector<std::string>& args);
int align_command(const std::vector<std::string>& args);
int ablate_command(const std::vector<std::string>& args);

}  // namespace kernmap::cli
