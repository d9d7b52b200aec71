#include "cli/options.h"

#include <CLI/CLI.hpp>

#include <charconv>
#include <cmath>
#include <system_error>

#include "cli/table.h"

namespace kernmap::cli {
namespace {

std::string shortest(double v) {
  char buf[32];
  const auto [end, ec] = std::to_chars(buf, buf + sizeof buf, v);
  return std::string(buf, ec == std::errc() ? end : buf);
}

// The whole text as an integer in [lo, hi]: from_chars stops at the first character that is not a digit, so a
// value is taken only when it used every character.
int64_t parse_integer(const std::string& text, int64_t lo, int64_t hi) {
  int64_t v = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || end != text.data() + text.size() || v < lo || v > hi)
    throw std::invalid_argument("out of range");
  return v;
}

double parse_real(const std::string& text, Sign sign) {
  double v = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || end != text.data() + text.size() || !std::isfinite(v) ||
      (sign == Sign::kPositive ? !(v > 0) : !(v >= 0)))
    throw std::invalid_argument("out of range");
  return v;
}

std::string integer_range(int64_t lo, int64_t hi) {
  return "an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]";
}

CLI::Option* integer_option(CLI::App& app, const std::string& name, int64_t lo, int64_t hi,
                            int64_t default_value, std::function<void(int64_t)> set,
                            const std::string& help) {
  return add_value(
      app, name, "N", integer_range(lo, hi),
      [lo, hi, set = std::move(set)](const std::string& v) { set(parse_integer(v, lo, hi)); },
      help + " (" + std::to_string(lo) + ".." + std::to_string(hi) + ", default " +
          std::to_string(default_value) + ")");
}

std::string real_range(Sign sign) {
  return sign == Sign::kPositive ? "a finite number > 0" : "a finite number >= 0";
}

}  // namespace

std::string bad_value(const std::string& name, const std::string& expected, const std::string& value) {
  return name + " must be " + expected + ", got '" + value + "'";
}

CLI::Option* add_value(CLI::App& app, const std::string& name, const std::string& type,
                       const std::string& expected, std::function<void(const std::string&)> set,
                       const std::string& help) {
  // Zero or one value, so that a missing value reaches the callback (as "") instead of CLI11 taking the next
  // option as the value; a value that starts with a digit ("-1") is still taken as one.
  CLI::Option* option = app.add_option(
      name,
      [name, expected, set = std::move(set)](const CLI::results_t& results) {
        if (results.empty() || results.back().empty())
          throw CLI::ValidationError(name + " needs " + expected);
        try {
          set(results.back());
        } catch (const std::invalid_argument&) {
          throw CLI::ValidationError(bad_value(name, expected, results.back()));
        }
        return true;
      },
      help);
  option->type_name(type)->expected(0, 1)->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  return option;
}

CLI::Option* add_integer(CLI::App& app, const std::string& name, int64_t& target, int64_t lo, int64_t hi,
                         const std::string& help) {
  return integer_option(
      app, name, lo, hi, target, [&target](int64_t v) { target = v; }, help);
}

CLI::Option* add_integer(CLI::App& app, const std::string& name, int& target, int lo, int hi,
                         const std::string& help) {
  return integer_option(
      app, name, lo, hi, target, [&target](int64_t v) { target = static_cast<int>(v); }, help);
}

CLI::Option* add_real(CLI::App& app, const std::string& name, double& target, Sign sign,
                      const std::string& help) {
  return add_value(
      app, name, "X", real_range(sign),
      [&target, sign](const std::string& v) { target = parse_real(v, sign); },
      help + " (" + (sign == Sign::kPositive ? "> 0" : ">= 0") + ", default " + shortest(target) + ")");
}

CLI::Option* add_real(CLI::App& app, const std::string& name, std::optional<double>& target, Sign sign,
                      const std::string& help) {
  return add_value(
      app, name, "X", real_range(sign),
      [&target, sign](const std::string& v) { target = parse_real(v, sign); }, help);
}

CLI::Option* add_choice(CLI::App& app, const std::string& name, std::string& target,
                        const std::vector<std::string>& choices, const std::string& help) {
  return add_value(
      app, name, join(choices, "|"), "one of " + join(choices),
      [&target, choices](const std::string& v) {
        for (const std::string& c : choices)
          if (v == c) {
            target = v;
            return;
          }
        throw std::invalid_argument("not a choice");
      },
      help + " (default " + target + ")");
}

CLI::Option* add_text(CLI::App& app, const std::string& name, std::string& target, const std::string& type,
                      const std::string& expected, const std::string& help) {
  return add_value(
      app, name, type, expected, [&target](const std::string& v) { target = v; }, help);
}

}  // namespace kernmap::cli
