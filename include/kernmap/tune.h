// tune: the measured kernel choice (docs/mapping.md, "Verified and tuned mappings"). Every eligible kernel of
// each kernel layer a model bears, timed forward+backward in training mode on the model's live inputs (one
// sample step's kernel calls, captured as kernelize's Verify captures them), each verified against the
// layer's reference; the fastest verified one wins, and the winners go to a mapping file in the existing
// format with the comparison beside it. The C++ twin of kernmap.tune (python/kernmap/_tune.py).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "kernmap/export.h"
#include "kernmap/layers.h"
#include "kernmap/registry.h"

namespace kernmap {

/// One kernel of a layer as tune measured it.
struct KERNMAP_API TuneCandidate {
  std::string kernel;
  std::optional<double> median_ms;  ///< one sample step's calls of the layer, forward and backward
  std::optional<double> error;      ///< the worst element over those calls (nullopt when not run)
  std::optional<double> tolerance;  ///< its tolerance
  std::string verdict;              ///< "winner", or why it lost ("slower: ...", "failed verify: ...", ...)
};

/// One layer: how often the sample step called it, its shape classes, every candidate and the winner.
struct KERNMAP_API TuneLayer {
  std::string layer;
  int64_t calls = 0;                ///< modules of the layer the sample step called
  std::vector<std::string> shapes;  ///< "2x9x32 float32 (5)": the first tensor argument's shape, with counts
  std::string winner;               ///< empty when no candidate could be timed
  std::vector<TuneCandidate> candidates;
};

/// The machine a tune measured on, for the mapping file's header.
struct KERNMAP_API TuneMachine {
  std::string host, cpu, arch;
  int64_t cores = 0, threads = 0;
  std::string aten_cpu_level;       ///< ATen's CPU capability ("AVX512")
  std::string kernmap_cpu_level;    ///< kernmap's CPU kernels' level ("avx512")
  std::string kernmap_cpu_isa_env;  ///< KERNMAP_CPU_ISA, empty when unset
  std::string torch, kernmap, date;
};

/// What tune measured.
struct KERNMAP_API TuneResult {
  std::string device;
  TuneMachine machine;
  std::vector<TuneLayer> layers;
  /// layer -> the winning kernel.
  std::map<std::string, std::string> winners() const;
  /// The winners as a mapping: layer -> device -> training -> kernel (register_mapping, ScopedMapping).
  Mapping mapping() const;
  /// An aligned table: layer, calls, kernel, median ms, error / tolerance, verdict (Python's TuneResult).
  std::string table() const;
  /// {"kernmap_tune": 1, "device", "machine", "mapping", "layers": [...]}: Python's <stem>.tune.json.
  std::string json() const;
};

/// warmup untimed and reps timed runs of each candidate, the candidates interleaved.
struct KERNMAP_API TuneOptions {
  int64_t warmup = 3;
  int64_t reps = 10;
};

/// Captures the sample step (step.step runs one forward of a training batch, labels included, and returns
/// the loss), then per layer times every registered kernel that runs on the device, the dtype and the live
/// shapes with a backward (built in and plugins) and the reference, each verified first as kernelize's
/// Verify verifies; the winner has the least median of the verified ones. The module's layers keep their
/// kernels; parameters and gradients are untouched. Throws std::invalid_argument for warmup < 0, reps < 1 or
/// an empty step.
KERNMAP_API TuneResult tune(torch::nn::Module& module, const std::string& device, const Verify& step,
                            const TuneOptions& options = {});

/// Writes the winners to path as a mapping file (.toml: with the machine and every candidate's figures as
/// comments, Python's header lines; .json: the mapping alone) and the whole comparison to <stem>.tune.json
/// beside it; returns that side file's path. Throws std::invalid_argument for another extension and
/// std::runtime_error naming the file when it cannot be written.
KERNMAP_API std::string write_tune_files(const TuneResult& result, const std::string& path);

}  // namespace kernmap
