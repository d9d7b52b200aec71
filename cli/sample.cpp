#include "cli/sample.h"

#include <ATen/core/TensorBody.h>

#include <utility>

namespace kernmap::cli {

SampleModel load_sample(const std::string& preset, const std::string& model_dir, const std::string& dtype,
                        const std::string& data_path, int64_t batch_size, int64_t seq_len) {
  const at::TensorOptions options =
      at::TensorOptions().dtype(dtype == "float32" ? at::kFloat : at::kBFloat16);
  auto model = preset.empty() ? from_pretrained(model_dir, options) : make_preset(preset, options);
  const int64_t vocab = model->config().vocab_size;
  const train::Dataset data = data_path.empty() ? train::synthetic_dataset(vocab, batch_size, seq_len)
                                                : train::read_jsonl(data_path, vocab, false);
  Verify step = train::sample_step(*model, data, batch_size);
  return {std::move(model), std::move(step), data.source};
}

}  // namespace kernmap::cli
