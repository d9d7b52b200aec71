// kernmap: what is registered and what resolves on this machine, and kernel benchmarks.
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "cli/options.h"

namespace {

constexpr const char* kUsage =
    "usage: kernmap <command> [options]\n"
    "\n"
    "commands:\n"
    "  kernels [--json]                       registered kernels, what each layer resolves to here, and the\n"
    "                                         plugin packages of KERNMAP_PATH: offered, loaded, or why not\n"
    "  lock DIR                               write DIR/kernmap.lock pinning each package of the kernel\n"
    "                                         repository DIR (name, version, sha256 of each library)\n"
    "  bench ops [--json] [--filter REGEX]    kernmap kernels against the reference, with GB/s and % of\n"
    "            [--warmup N] [--reps N]      the machine's measured copy bandwidth\n"
    "  plan (--preset NAME | --model DIR)     the kernel each layer of a model gets here, and why (the\n"
    "       [--mode training|inference]       kernelize report), without running the model; presets:\n"
    "       [--device cpu] [--json]           qwen2-tiny, qwen2-moe-tiny, qwen3-moe-tiny\n"
    "  train  (--preset NAME | --model DIR)   SFT: per-step loss, grad_norm, ms, tokens/s; [--data FILE]\n"
    "         [--steps N] [--save DIR]        (JSONL prompt_ids/response_ids; default synthetic)\n"
    "         [--save-every N] [--resume DIR] [--skip-bad-lines] [--dtype float32|bfloat16]\n"
    "  align  (--preset NAME | --model DIR)   original vs kernelized run, per step, and a verdict\n"
    "         [--data FILE] [--steps N] [--kernels all|none|LIST] [--rtol X]\n"
    "  ablate (--preset NAME | --model DIR)   step time: original, +each kernel, all (interleaved,\n"
    "         [--steps N] [--warmup N]        medians, spread, speedup %, peak memory)\n"
    "  common: --batch-size N --seq-len N --examples N --lr X --weight-decay X --max-grad-norm X --json\n"
    "\n"
    "every command: --mapping FILE   user mappings from a .json or .toml file (docs/mapping.md), applied\n"
    "                                in order before the command; repeatable\n"
    "\n"
    "environment: KERNMAP_DISABLE=all|Layer,...  KERNMAP_LOG=1  "
    "KERNMAP_CPU_ISA=baseline|avx2|avx512|avx512bf16\n"
    "             KERNMAP_PATH=REPO:REPO (plugins, loaded before every command)  "
    "KERNMAP_TOOLKITS=cuda=12.8,cann=8.0\n";

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty() || args[0] == "-h" || args[0] == "--help" || args[0] == "help") {
    std::fputs(kUsage, args.empty() ? stderr : stdout);
    return args.empty() ? 2 : 0;
  }
  const std::string command = args[0];
  args.erase(args.begin());
  try {
    kernmap::cli::load_env_plugins();
    // After plugins are loaded, so that a mapping file can name their kernels.
    if (const int status = kernmap::cli::apply_mapping_options(command, args); status != 0) return status;
    if (command == "kernels") return kernmap::cli::kernels_command(args);
    if (command == "bench") return kernmap::cli::bench_command(args);
    if (command == "plan") return kernmap::cli::plan_command(args);
    if (command == "train") return kernmap::cli::train_command(args);
    if (command == "align") return kernmap::cli::align_command(args);
    if (command == "ablate") return kernmap::cli::ablate_command(args);
    if (command == "lock") return kernmap::cli::lock_command(args);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kernmap %s: %s\n", command.c_str(), e.what());
    return 1;
  }
  std::fprintf(stderr, "kernmap: unknown command '%s'\n\n%s", command.c_str(), kUsage);
  return 2;
}
