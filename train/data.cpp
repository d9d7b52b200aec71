// SFT data: token-id JSONL with every malformed line reported by number (each line parsed by
// train/jsonl_format.cpp), the synthetic default, batches.
#include <ATen/ops/full.h>

#include <algorithm>
#include <fstream>
#include <istream>
#include <random>
#include <sstream>
#include <string>

#include "kernmap/train.h"
#include "train/jsonl_format.h"

namespace kernmap::train {

Dataset read_jsonl(std::istream& in, const std::string& source, int64_t vocab_size, bool skip_bad_lines) {
  Dataset data;
  data.source = source;
  std::string line;
  int64_t number = 0;
  // A read error (EIO, EISDIR, ...) makes the file buffer throw, which getline turns into badbit and, with
  // badbit in exceptions(), rethrows: caught here, it cannot pass for the end of the file and truncate the
  // data unnoticed.
  const std::ios::iostate previous = in.exceptions();
  try {
    in.exceptions(std::ios::badbit);
    while (std::getline(in, line)) {
      ++number;
      if (jsonl::is_blank(line)) continue;
      jsonl::LineIds ids;
      if (std::string problem = jsonl::parse_line(line, vocab_size, ids); !problem.empty()) {
        data.skipped.push_back({number, problem});
        continue;
      }
      data.examples.push_back({std::move(ids.prompt_ids), std::move(ids.response_ids)});
    }
  } catch (const std::ios_base::failure& e) {
    in.exceptions(previous);
    throw DataError(source + ": read error after line " + std::to_string(number) + ": " + e.what(),
                    data.skipped);
  }
  in.exceptions(previous);
  if (!data.skipped.empty() && !skip_bad_lines) {
    std::ostringstream msg;
    msg << source << ": " << data.skipped.size() << " malformed line" << (data.skipped.size() == 1 ? "" : "s")
        << " (--skip-bad-lines skips them):";
    for (const DataIssue& issue : data.skipped) msg << "\n  line " << issue.line << ": " << issue.problem;
    throw DataError(msg.str(), data.skipped);
  }
  if (data.examples.empty()) throw DataError(source + ": no usable examples", data.skipped);
  return data;
}

Dataset read_jsonl(const std::string& path, int64_t vocab_size, bool skip_bad_lines) {
  std::ifstream in(path);
  if (!in) throw DataError(path + ": cannot open", {});
  return read_jsonl(in, path, vocab_size, skip_bad_lines);
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
  if (n == 0 || step < 0 || batch_size < 1)
    throw std::invalid_argument("make_batch: needs examples, step >= 0 and batch_size >= 1, got " +
                                std::to_string(n) + " examples, step " + std::to_string(step) +
                                ", batch_size " + std::to_string(batch_size));
  std::vector<const Example*> rows;
  int64_t len = 0;
  for (int64_t b = 0; b < batch_size; ++b) {
    // In 128 bits: step * batch_size passes 2^63 long before a step count does (Trainer bounds steps at
    // 2^53).
    const auto index = (static_cast<unsigned __int128>(step) * static_cast<uint64_t>(batch_size) + b) % n;
    rows.push_back(&data.examples[static_cast<size_t>(index)]);
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
