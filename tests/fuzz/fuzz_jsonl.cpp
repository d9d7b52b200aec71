// libFuzzer target: arbitrary bytes as an SFT data file, line by line through the JSONL line parser. Parsing
// never throws; a line it accepts has a non-empty response, at least 2 tokens, and every id inside the
// vocabulary; a line it refuses has a description of the problem.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "train/jsonl_format.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  namespace jsonl = kernmap::train::jsonl;
  constexpr int64_t kVocab = 1000;
  std::string_view text(reinterpret_cast<const char*>(data), size);
  while (!text.empty()) {
    const size_t end = text.find('\n');
    const std::string_view line = text.substr(0, end);
    text.remove_prefix(end == std::string_view::npos ? text.size() : end + 1);
    if (jsonl::is_blank(line)) continue;
    jsonl::LineIds ids;
    const std::string problem = jsonl::parse_line(line, kVocab, ids);
    if (!problem.empty()) continue;
    if (ids.response_ids.empty() || ids.prompt_ids.size() + ids.response_ids.size() < 2) std::abort();
    for (const auto* list : {&ids.prompt_ids, &ids.response_ids})
      for (int64_t id : *list)
        if (id < 0 || id >= kVocab) std::abort();
  }
  return 0;
}
