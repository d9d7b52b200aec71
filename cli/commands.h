// The `kernmap` subcommands. Each adds itself to the command line as a CLI11 subcommand whose options fill
// state the command holds; main parses, then runs the selected command's check and, after the plugins and the
// --mapping files are loaded, its run.
#pragma once

#include <functional>
#include <vector>

namespace CLI {
class App;
}  // namespace CLI

namespace kernmap::cli {

struct Command {
  CLI::App* app = nullptr;
  /// What depends on several options (throws UsageError); runs before the plugins load.
  std::function<void()> check = [] {};
  /// The command itself; returns the exit code.
  std::function<int()> run;
};

/// Loads the plugin packages of KERNMAP_PATH; refusals go to stderr (and `kernmap kernels` shows them all).
void load_env_plugins();

Command add_kernels_command(CLI::App& parent);
Command add_lock_command(CLI::App& parent);
Command add_bench_command(CLI::App& parent);
Command add_plan_command(CLI::App& parent);
Command add_tune_command(CLI::App& parent);
/// train, align and ablate.
std::vector<Command> add_run_commands(CLI::App& parent);

}  // namespace kernmap::cli
