// Typed command-line options on CLI11: each value is parsed whole and checked when the command line is
// parsed, and a bad one is refused with a message naming the option, the value and what it expects:
//   NAME must be EXPECTED, got 'VALUE'        (a value that does not parse or is out of range)
//   NAME needs EXPECTED                       (the option is last, or followed by another option)
// A repeated option takes its last value.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace CLI {
class App;
class Option;
}  // namespace CLI

namespace kernmap::cli {

/// A command line that cannot run (exit code 2, as for an unknown option): a value that is only known to be
/// wrong once the command runs (a device no kernel names), or options that contradict each other.
class UsageError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

/// "NAME must be EXPECTED, got 'VALUE'": the message of every refused value.
std::string bad_value(const std::string& name, const std::string& expected, const std::string& value);

/// An option taking one value: `set` receives it (never empty) and throws std::invalid_argument when it is
/// not what `expected` says. `type` is the value's placeholder in --help (N, FILE, X).
CLI::Option* add_value(CLI::App& app, const std::string& name, const std::string& type,
                       const std::string& expected, std::function<void(const std::string&)> set,
                       const std::string& help);

/// A whole integer in [lo, hi] ("10x", "1e3", "abc" and values past int64 are refused).
CLI::Option* add_integer(CLI::App& app, const std::string& name, int64_t& target, int64_t lo, int64_t hi,
                         const std::string& help);
CLI::Option* add_integer(CLI::App& app, const std::string& name, int& target, int lo, int hi,
                         const std::string& help);

/// What a real-valued option accepts besides being finite.
enum class Sign { kPositive, kNonNegative };
/// A finite real number, > 0 or >= 0.
CLI::Option* add_real(CLI::App& app, const std::string& name, double& target, Sign sign,
                      const std::string& help);
/// The same, for an option whose default depends on other options (unset until given).
CLI::Option* add_real(CLI::App& app, const std::string& name, std::optional<double>& target, Sign sign,
                      const std::string& help);

/// One of `choices`.
CLI::Option* add_choice(CLI::App& app, const std::string& name, std::string& target,
                        const std::vector<std::string>& choices, const std::string& help);

/// Any non-empty text (a path, a name): `expected` says what in the message when it is missing ("a folder").
CLI::Option* add_text(CLI::App& app, const std::string& name, std::string& target, const std::string& type,
                      const std::string& expected, const std::string& help);

}  // namespace kernmap::cli
