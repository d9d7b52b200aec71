// kernmap mapping files: user mappings in JSON or TOML, registered without code (docs/mapping.md, "Mapping
// files").
//
//   # kernmap.toml                              // kernmap.json
//   [RMSNorm.cpu]                               {"RMSNorm": {"cpu": {"training": "kernmap/rms_norm",
//   training = "kernmap/rms_norm"                                    "inference": "kernmap/rms_norm"}},
//   inference = "kernmap/rms_norm"               "SiluAndMul": {"cpu": "kernmap/silu_and_mul"}}
//   [SiluAndMul]
//   cpu = "kernmap/silu_and_mul"                // a device mapped straight to a kernel: its "fallback" entry
//
// The format is chosen by the extension (.json or .toml). The shape is the mapping the registry takes
// (layer -> device -> mode -> kernel), with a device mapped straight to a kernel name as the shorthand for
// {"fallback": kernel}, and an optional top-level `kernmap_mapping = 1` (the format version).
//
// Every problem throws MappingFileError whose message starts with the location: "FILE:LINE:COL: problem" for
// TOML and for JSON syntax errors, "FILE: /Layer/device/mode: problem" (the key path) for JSON entries. Names
// are checked against the registry when the file is loaded, so load a file after the plugins whose kernels it
// names.
#pragma once

#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernmap/export.h"
#include "kernmap/registry.h"

namespace kernmap {

/// A mapping file that cannot be read, parsed or validated. The message gives the location and the problem; a
/// file with several invalid entries lists each, one per line.
class KERNMAP_API MappingFileError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

/// Reads, parses and validates a mapping file against the registry as it stands: every layer must be known
/// (have a reference kernel), every device a torch device type or a device some registered kernel names,
/// every mode one of inference, training, inference+compile, training+compile, fallback, and every kernel
/// registered, for that layer, and able to run on that device. Returns the mapping, ready for
/// register_mapping or ScopedMapping. Throws MappingFileError.
KERNMAP_API Mapping load_mapping_file(const std::string& path);

/// load_mapping_file, then register_mapping: the file's entries become user registrations (a (layer, device)
/// entry replaces an earlier one). Nothing is registered when the file has any error.
KERNMAP_API void register_mapping_file(const std::string& path);

/// One table of a mapping file to write: the comment lines above it (each written after "# "), and the
/// kernels of one (layer, device) pair by mode.
struct KERNMAP_API MappingFileSection {
  std::vector<std::string> comments;
  std::string layer, device;
  std::map<Mode, std::string> modes;
};

/// A mapping file's text in the format of path's extension (.toml or .json): the header lines as "# "
/// comments, `kernmap_mapping = 1`, then each section as a [layer.device] table of mode = "kernel" entries
/// under its comments (TOML); or {"kernmap_mapping": 1, layer: {device: {mode: kernel}}} without the comments
/// (JSON, indented by 2, as Python's json.dumps(indent=2)). What load_mapping_file and
/// kernmap.load_mapping_file read back as the same mapping. Throws MappingFileError for another extension.
KERNMAP_API std::string mapping_file_text(const std::string& path, const std::vector<std::string>& header,
                                          const std::vector<MappingFileSection>& sections);

/// Writes mapping_file_text to path whole or not at all (a temporary file renamed over it). Throws
/// MappingFileError for another extension, std::runtime_error naming the file and the system's reason when
/// it cannot be written.
KERNMAP_API void write_mapping_file(const std::string& path, const std::vector<std::string>& header,
                                    const std::vector<MappingFileSection>& sections);

}  // namespace kernmap
