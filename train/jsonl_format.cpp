// One SFT data line: its JSON object and token ids checked, every problem described (torch-free; see
// jsonl_format.h).
#include "train/jsonl_format.h"

#include <algorithm>
#include <cctype>
#include <nlohmann/json.hpp>

#include "models/json_document.h"

namespace kernmap::train::jsonl {
namespace {

using nlohmann::json;

std::string quoted(const char* key) {
  return std::string("\"") + key + "\"";
}

// The ids under key, or a problem description.
std::string read_ids(const json& object, const char* key, int64_t vocab_size, std::vector<int64_t>& out) {
  const auto it = object.find(key);
  if (it == object.end()) return "missing " + quoted(key);
  const json& ids = *it;
  if (!ids.is_array()) return quoted(key) + " must be an array of token ids, got " + ids.dump();
  out.clear();
  out.reserve(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    const json& id = ids[i];
    const std::string where = quoted(key) + "[" + std::to_string(i) + "]";
    if (!id.is_number_integer()) return where + " must be an integer, got " + id.dump();
    // Integers above INT64_MAX are stored unsigned: read them as such, so the message shows the value in the
    // file rather than its wrap-around.
    const bool above_int64 = id.is_number_unsigned() && id.get<uint64_t>() > uint64_t{INT64_MAX};
    const int64_t v = above_int64 ? -1 : id.get<int64_t>();
    if (above_int64 || v < 0 || v >= vocab_size)
      return where + " = " + (above_int64 ? std::to_string(id.get<uint64_t>()) : std::to_string(v)) +
             " is outside the vocabulary [0, " + std::to_string(vocab_size) + ")";
    out.push_back(v);
  }
  return {};
}

}  // namespace

bool is_blank(std::string_view line) {
  return std::all_of(line.begin(), line.end(), [](unsigned char c) { return std::isspace(c); });
}

std::string parse_line(std::string_view line, int64_t vocab_size, LineIds& out) {
  json object;
  try {
    object = json_document::parse(line);
  } catch (const json_document::Error& e) {
    return std::string("not valid JSON: ") + e.what();
  }
  if (!object.is_object()) return "not a JSON object";
  if (std::string p = read_ids(object, "prompt_ids", vocab_size, out.prompt_ids); !p.empty()) return p;
  if (std::string p = read_ids(object, "response_ids", vocab_size, out.response_ids); !p.empty()) return p;
  if (out.response_ids.empty()) return "\"response_ids\" is empty (nothing to train on)";
  if (out.prompt_ids.size() + out.response_ids.size() < 2)
    return "fewer than 2 tokens (a single token predicts nothing)";
  return {};
}

}  // namespace kernmap::train::jsonl
