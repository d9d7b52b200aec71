// libFuzzer target: arbitrary bytes as the trainer checkpoint of a fixed two-parameter model, through the
// torch-free half of Trainer::load_checkpoint: the safetensors header parsed and validated, its tensors
// checked against the checkpoint layout (names, dtypes, shapes), the step read and bounded. Each step must
// either pass or throw its FormatError; anything else (a crash, a sanitizer report, another exception) is a
// bug. A file that passes holds exactly the expected tensors, and a step in [0, 2^53].
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <set>
#include <string>
#include <vector>

#include "models/safetensors_format.h"
#include "train/checkpoint_format.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  namespace st = kernmap::safetensors;
  namespace cf = kernmap::train::checkpoint_format;
  static const std::vector<cf::TensorSpec> expected =
      cf::checkpoint_tensors({{"model.w", "F32", {2, 3}}, {"model.b", "BF16", {3}}});
  try {
    const st::Header header = st::parse_file(data, size);
    std::vector<cf::TensorSpec> found;
    for (const st::TensorInfo& t : header.tensors)
      found.push_back({t.name, std::string(st::dtype_name(t.dtype)), t.shape});
    cf::check_tensors(found, expected);
    std::set<std::string> names;
    for (const cf::TensorSpec& t : found) names.insert(t.name);
    if (names.size() != expected.size() || found.size() != expected.size()) std::abort();
    const st::TensorInfo* step = header.find(cf::kStepTensor);
    if (step == nullptr || step->end - step->begin != 8) std::abort();
    int64_t value = 0;
    for (int i = 7; i >= 0; --i)
      value = static_cast<int64_t>((static_cast<uint64_t>(value) << 8) |
                                   data[header.data_start + step->begin + i]);
    cf::check_step(value);
    if (value < 0 || value > cf::kMaxStep) std::abort();
  } catch (const st::FormatError&) {
  } catch (const cf::FormatError&) {
  }
  return 0;
}
