// A test driver for the Python suite (tests/python/test_models.py): loads a Hugging Face checkpoint into the
// C++ model, runs it, and writes what transformers is compared against. Not installed; not a user tool.
//
//   kernmap_model_probe load DIR                          load config + weights; "ok" or the error (exit 1)
//   kernmap_model_probe run DIR INPUTS OUT [MODE]         INPUTS: safetensors with input_ids, labels (int64
//                                                          [B, S]); OUT: logits (a forward without labels),
//                                                          loss and grad.<parameter> for every parameter (one
//                                                          with labels); MODE: reference (default), training
//                                                          or inference (kernelized); the kernelize report
//                                                          goes to stdout as JSON
//   kernmap_model_probe save DIR OUTDIR [MAX_SHARD_BYTES] load, then save_pretrained
//   kernmap_model_probe preset NAME OUTDIR                save a built-in preset
#include <ATen/ATen.h>

#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include "kernmap/models.h"

namespace {

int run(const std::vector<std::string>& a) {
  using namespace kernmap;
  if (a.size() == 2 && a[0] == "load") {
    from_pretrained(a[1]);
    std::puts("ok");
    return 0;
  }
  if ((a.size() == 4 || a.size() == 5) && a[0] == "run") {
    auto model = from_pretrained(a[1]);
    const std::string mode = a.size() == 5 ? a[4] : "reference";
    const Report report =
        mode == "reference" ? restore_reference(*model) : kernelize(*model, "cpu", parse_mode(mode));
    std::puts(report.json().c_str());
    at::Tensor ids, labels;
    for (auto& [name, t] : read_safetensors(a[2])) (name == "input_ids" ? ids : labels) = t;
    at::Tensor logits;
    {
      at::NoGradGuard no_grad;
      logits = model->forward(ids).logits;
    }
    const CausalLMOutput out = model->forward(ids, labels);
    out.loss.backward();
    std::vector<std::pair<std::string, at::Tensor>> tensors = {{"logits", logits},
                                                               {"loss", out.loss.detach()}};
    for (const auto& p : model->named_parameters()) tensors.emplace_back("grad." + p.key(), p.value().grad());
    write_safetensors(a[3], tensors);
    return 0;
  }
  if ((a.size() == 3 || a.size() == 4) && a[0] == "save") {
    from_pretrained(a[1])->save_pretrained(a[2], a.size() == 4 ? std::stoull(a[3]) : 0);
    return 0;
  }
  if (a.size() == 3 && a[0] == "preset") {
    make_preset(a[1])->save_pretrained(a[2]);
    return 0;
  }
  std::fputs(
      "usage: kernmap_model_probe load DIR | run DIR INPUTS OUT [MODE] | save DIR OUTDIR [MAX_SHARD_BYTES] | "
      "preset NAME OUTDIR\n",
      stderr);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(std::vector<std::string>(argv + 1, argv + argc));
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what_without_backtrace());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
  }
  return 1;
}
