// The SFT data format, one line at a time, without torch: a JSONL line {"prompt_ids": [int...],
// "response_ids": [int...]} parsed and checked. Kept torch-free so that the libFuzzer target (tests/fuzz/)
// links it alone; reading files and building batches is train/data.cpp.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace kernmap::train::jsonl {

/// The token ids of one example.
struct LineIds {
  std::vector<int64_t> prompt_ids;
  std::vector<int64_t> response_ids;
};

/// Whether a line holds only whitespace (such lines are not examples).
bool is_blank(std::string_view line);

/// Parses one line into `out`. Returns "" for an example, else what is wrong with the line: not one JSON
/// object (a NUL byte anywhere included), either key missing or not a list, an id that is not an integer or
/// is outside [0, vocab_size) (named by its exact value, 64-bit ids included), an empty response, or fewer
/// than 2 tokens in all. Never throws for any input.
std::string parse_line(std::string_view line, int64_t vocab_size, LineIds& out);

}  // namespace kernmap::train::jsonl
