// kernmap: what is registered and what resolves on this machine, model plans, training runs that prove a
// mapping, and kernel benchmarks. CLI11 parses the command line, each value checked as it is read
// (cli/options.h); then the plugins of KERNMAP_PATH load, the --mapping files apply in order (so that they
// can name the plugins' kernels), and the command runs.
//
// Exit codes: 0 done; 1 the command failed (or align's verdict is FAIL); 2 the command line is wrong (an
// unknown command, option or value, a mapping file with an error).
#include <c10/util/Exception.h>
#include <CLI/CLI.hpp>

#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "cli/options.h"
#include "kernmap/mapping_file.h"

namespace kernmap::cli {
namespace {

constexpr const char* kDescription =
    "kernmap: maps the layers of transformer models onto fused kernels. `kernmap COMMAND --help` lists a "
    "command's options.";

constexpr const char* kEnvironment =
    "Environment:\n"
    "  KERNMAP_DISABLE=all|Layer,...  layers kept on their reference kernels\n"
    "  KERNMAP_LOG=1                  what each resolution chose and why, on stderr\n"
    "  KERNMAP_CPU_ISA=baseline|avx2|avx512|avx512bf16|amx   caps the CPU kernels' instruction set\n"
    "  KERNMAP_PATH=REPO:REPO         local kernel repositories (plugins, loaded before every command)\n"
    "  KERNMAP_TOOLKITS=cuda=12.8,cann=8.0   toolkit versions plugin variants are matched against";

constexpr const char* kMappingNote = "Every command also takes --mapping FILE (kernmap --help).";

std::string prefix_of(const std::string& command) {
  return command.empty() ? "kernmap: " : "kernmap " + command + ": ";
}

void print_error(const std::string& command, const std::string& message) {
  const std::string prefix = prefix_of(command);
  // write_lock's messages already start with "kernmap lock: ".
  const bool named = message.rfind(prefix, 0) == 0;
  std::fprintf(stderr, "%s%s\n", named ? "" : prefix.c_str(), message.c_str());
}

// "bench ops": the selected subcommands below app, for the --help hint.
std::string selected_path(const CLI::App& app) {
  const std::vector<const CLI::App*> subs =
      app.get_subcommands([](const CLI::App* s) { return s->parsed(); });
  if (subs.empty()) return "";
  const std::string below = selected_path(*subs.front());
  return subs.front()->get_name() + (below.empty() ? "" : " " + below);
}

// Every subcommand falls through to the top level (where --mapping is), so each argument no command took is
// in app.remaining(true).
int extras_error(const CLI::App& app, const Command* command) {
  const std::vector<std::string> extras = app.remaining(true);
  const std::string first = extras.empty() ? "" : extras.front();
  const bool option = !first.empty() && first[0] == '-';
  if (command == nullptr) {
    std::fprintf(stderr, "kernmap: unknown %s '%s'\n\n%s", option ? "option" : "command", first.c_str(),
                 app.help().c_str());
    return 2;
  }
  print_error(command->app->get_name(), std::string(option ? "unknown option '" : "unexpected argument '") +
                                            first + "' (kernmap " + selected_path(app) +
                                            " --help lists its options)");
  return 2;
}

// After the plugins, so that a mapping file can name their kernels; a later file's (layer, device) entries
// replace an earlier one's.
bool apply_mapping_files(const std::string& command, const std::vector<std::string>& files) {
  for (const std::string& file : files) {
    try {
      register_mapping_file(file);
    } catch (const std::exception& e) {
      print_error(command, e.what());  // the message starts with the file
      return false;
    }
  }
  return true;
}

int run(int argc, char** argv) {
  CLI::App app{kDescription, "kernmap"};
  app.get_formatter()->label("SUBCOMMAND", "COMMAND");
  app.get_formatter()->column_width(36);
  app.require_subcommand(0, 1);
  app.footer(kEnvironment);
  std::vector<std::string> mapping_files;
  app.add_option(
         "--mapping",
         [&mapping_files](const CLI::results_t& files) {
           for (const std::string& f : files) {
             if (f.empty()) throw CLI::ValidationError("--mapping needs a file (.json or .toml)");
             mapping_files.push_back(f);
           }
           return true;
         },
         "user mappings from a .json or .toml file (docs/mapping.md), applied in order before the command; "
         "repeatable, before or after the command")
      ->type_name("FILE")
      ->expected(0, 1)
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);

  std::vector<Command> commands = {add_kernels_command(app), add_lock_command(app), add_bench_command(app),
                                   add_plan_command(app), add_tune_command(app)};
  for (Command& c : add_run_commands(app)) commands.push_back(std::move(c));
  for (Command& c : commands) {
    c.app->group("Commands")->fallthrough();
    c.app->footer(kMappingNote);
    for (CLI::App* sub : c.app->get_subcommands({})) sub->footer(kMappingNote);
  }
  auto selected = [&]() -> const Command* {
    for (const Command& c : commands)
      if (c.app->parsed()) return &c;
    return nullptr;
  };

  if (argc < 2) {
    std::fputs(app.help().c_str(), stderr);
    return 2;
  }
  if (argc == 2 && std::string(argv[1]) == "help") {
    std::fputs(app.help().c_str(), stdout);
    return 0;
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    std::fputs(app.help().c_str(), stdout);  // the help of the deepest command given
    return 0;
  } catch (const CLI::ExtrasError&) {
    return extras_error(app, selected());
  } catch (const CLI::ParseError& e) {
    const Command* command = selected();
    print_error(command ? command->app->get_name() : "", e.what());
    return 2;
  }
  const Command* command = selected();
  if (command == nullptr) {
    std::fprintf(stderr, "kernmap: no command given\n\n%s", app.help().c_str());
    return 2;
  }
  const std::string name = command->app->get_name();
  try {
    command->check();
    load_env_plugins();
    if (!apply_mapping_files(name, mapping_files)) return 2;
    return command->run();
  } catch (const UsageError& e) {
    print_error(name, e.what());
    return 2;
  } catch (const c10::Error& e) {
    print_error(name, e.what_without_backtrace());  // what() ends in a backtrace of torch's frames
    return 1;
  } catch (const std::exception& e) {
    print_error(name, e.what());
    return 1;
  }
}

}  // namespace
}  // namespace kernmap::cli

int main(int argc, char** argv) {
  return kernmap::cli::run(argc, argv);
}
