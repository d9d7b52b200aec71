// The model and the sample step that `kernmap plan --verify` and `kernmap tune` measure kernels on.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "kernmap/models.h"
#include "kernmap/train.h"

namespace kernmap::cli {

struct SampleModel {
  std::shared_ptr<CausalLM> model;
  Verify step;              // one forward of the data's first batch (train::sample_step)
  std::string data_source;  // the data as tables name it (train::Dataset::source)
};

// Loads the preset (or, when preset is empty, the checkpoint folder model_dir) in dtype "float32" or
// "bfloat16", and the sample step over the first batch of data_path's JSONL (or, when it is empty, of
// synthetic data of seq_len tokens).
SampleModel load_sample(const std::string& preset, const std::string& model_dir, const std::string& dtype,
                        const std::string& data_path, int64_t batch_size, int64_t seq_len);

}  // namespace kernmap::cli
