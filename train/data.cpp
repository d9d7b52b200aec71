// SFT data: token-id JSONL with every malformed line reported by number, the synthetic default, batches.
#include <ATen/ops/full.h>

#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>

#include "kernmap/train.h"

namespace kernmap::train {
namespace {

using nlohmann::json;

// The ids under key, or a problem description.
std::string read_ids(const json& object, const char* key, int64_t vocab_size, std::vector<int64_t>& out) {
  if (!object.contains(key)) return std::string("missing \"") + key + "\"";
  const json& ids = object[key];
  if (!ids.is_array()) return std::string("\"") + key + "\" must be an array of token ids, got " + ids.dump();
  out.reserve(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    const json& id = ids[i];
    if (!id.is_number_integer())
      return std::string("\"") + key + "\"[" + std::to_string(i) + "] must be an integer, got " + id.dump();
    const int64_t v = id.get<int64_t>();
    if (v < 0 || v >= vocab_size)
      return std::string("\"") + key + "\"[" + std::to_string(i) + "] = " + std::to_string(v) +
             " is outside the vocabulary [0, " + std::to_string(vocab_size) + ")";
    out.push_back(v);
  }
  return {};
}

std::string parse_line(const std::string& line, int64_t vocab_size, Example& ex) {
  json object = json::parse(line, nullptr, /*allow_exceptions=*/false);
  if (object.is_discarded()) return "not valid JSON";
  if (!object.is_object()) return "not a JSON object";
  if (std::string p = read_ids(object, "prompt_ids", vocab_size, ex.prompt_ids); !p.empty()) return p;
  if (std::string p = read_ids(object, "response_ids", vocab_size, ex.response_ids); !p.empty()) return p;
  if (ex.response_ids.empty()) return "\"response_ids\" is empty (nothing to train on)";
  if (ex.prompt_ids.size() + ex.response_ids.size() < 2)
    return "fewer than 2 tokens (a single token predicts nothing)";
  return {};
}

}  // namespace

Dataset read_jsonl(const std::string& path, int64_t vocab_size, bool skip_bad_lines) {
  std::ifstream in(path);
  if (!in) throw DataError(path + ": cannot open", {});
  Dataset data;
  data.source = path;
  std::string line;
  for (int64_t number = 1; std::getline(in, line); ++number) {
    if (std::all_of(line.begin(), line.end(), [](unsigned char c) { return std::isspace(c); })) continue;
    Example ex;
    if (std::string problem = parse_line(line, vocab_size, ex); !problem.empty()) {
      data.skipped.push_back({number, problem});
      continue;
    }
    data.examples.push_back(std::move(ex));
  }
  if (!data.skipped.empty() && !skip_bad_lines) {
    std::ostringstream msg;
    msg << path << ": " << data.skipped.size() << " malformed line" << (data.skipped.size() == 1 ? "" : "s")
        << " (--skip-bad-lines skips them):";
    for (const DataIssue& issue : data.skipped) msg << "\n  line " << issue.line << ": " << issue.problem;
    throw DataError(msg.str(), data.skipped);
  }
  if (data.examples.empty()) throw DataError(path + ": no usable examples", data.skipped);
  return data;
}

Dataset synthetic_dataset(int64_t vocab_size, int64_t num_examples, int64_t seq_len, uint64_t seed) {
  if (seq_len < 2 || num_examples < 1 || vocab_size < 2)
    throw std::invalid_argument("synthetic data needs seq_len >= 2, num_examples >= 1 and vocab_size >= 2");
  // mt19937_64 output is specified by the standard, so the data is the same everywhere (no distributions,
  // whose results are implementation-defined).
  std::mt19937_64 rng(seed);
  Dataset data;
  data.source = "synthetic(" + std::to_string(num_examples) + " x " + std::to_string(seq_len) +
                " tokens, seed " + std::to_string(seed) + ")";
  const int64_t prompt_len = seq_len / 2;
  for (int64_t e = 0; e < num_examples; ++e) {
    Example ex;
    for (int64_t i = 0; i < prompt_len; ++i)
      ex.prompt_ids.push_back(static_cast<int64_t>(rng() % vocab_size));
    // The response repeats the prompt shifted by one token id: learnable, so the loss falls.
    for (int64_t i = 0; i < seq_len - prompt_len; ++i)
      ex.response_ids.push_back((ex.prompt_ids[i % prompt_len] + 1) % vocab_size);
    data.examples.push_back(std::move(ex));
  }
  return data;
}

Batch make_batch(const Dataset& data, int64_t step, int64_t batch_size, int64_t pad_id) {
  const int64_t n = static_cast<int64_t>(data.examples.size());
  std::vector<const Example*> rows;
  int64_t len = 0;
  for (int64_t b = 0; b < batch_size; ++b) {
    rows.push_back(&data.examples[(step * batch_size + b) % n]);
    len = std::max<int64_t>(len, rows.back()->prompt_ids.size() + rows.back()->response_ids.size());
  }
  Batch batch;
  batch.input_ids = at::full({batch_size, len}, pad_id, at::kLong);
  batch.labels = at::full({batch_size, len}, -100, at::kLong);
  auto ids = batch.input_ids.accessor<int64_t, 2>();
  auto labels = batch.labels.accessor<int64_t, 2>();
  for (int64_t b = 0; b < batch_size; ++b) {
    int64_t t = 0;
    for (int64_t id : rows[b]->prompt_ids) ids[b][t++] = id;
    for (int64_t id : rows[b]->response_ids) {
      ids[b][t] = id;
      labels[b][t++] = id;
    }
    batch.tokens += t;
  }
  return batch;
}

}  // namespace kernmap::train
