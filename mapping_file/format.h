// Mapping files without the registry: reading the file, the JSON reader (json.cpp, nlohmann's SAX parser),
// the TOML reader (toml.cpp, toml++), and the document's shape ({layer: {device: kernel | {mode: kernel}}}).
// No torch and no registry here: the libFuzzer target (tests/fuzz/fuzz_mapping_file.cpp) links these sources
// alone. Checking names against the registry (layers, devices, modes, kernels) happens when a file is applied
// (mapping_file/validate.cpp), because kernels from plugins may be registered after a file is parsed.
//
// Inputs are untrusted: every limit below is checked before the stack grows with the input, and every problem
// is a mapping_file::Error whose message starts with the location ("FILE:LINE:COL: " for TOML and for JSON
// syntax errors, "FILE: /key/path: " for JSON structure errors).
#pragma once

#include <cstddef>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace kernmap::mapping_file {

constexpr std::size_t kMaxFileBytes = 1 << 20;  ///< a mapping file is a few hundred bytes; 1 MiB is generous
constexpr int kMaxDepth = 16;                   ///< nesting of tables/objects/arrays (the format uses 3)
constexpr std::size_t kMaxValues = 65536;       ///< values (tables included) in one document

/// A problem in a mapping file; what() starts with its location.
class Error : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

enum class Format { kJson, kToml };

/// The format from the file name: ".json" or ".toml" (case-insensitive); anything else throws Error naming
/// the file and the accepted extensions.
Format format_of(const std::string& path);

/// A position in the text; 1-based, columns count UTF-8 characters. {0, 0} when unknown (JSON values).
struct Location {
  int line = 0;
  int column = 0;
};

/// One value of a parsed document.
struct Node {
  /// JSON's kinds and TOML's (dates and times are TOML's only; null is JSON's only).
  enum class Kind { kTable, kString, kInteger, kFloat, kBoolean, kNull, kArray, kDate, kTime, kDateTime };

  Kind kind = Kind::kTable;
  std::string text;   ///< a string's value; an integer in decimal
  Location key_at;    ///< where the key naming this value was written
  Location value_at;  ///< where the value (or the table header) was written
  std::vector<std::pair<std::string, std::unique_ptr<Node>>> items;  ///< a table's entries, in file order
  std::map<std::string, std::size_t> index;                          ///< key -> position in items

  /// The entry under key, or nullptr.
  Node* find(const std::string& key) const;
  /// Appends an entry; the key must not be present.
  Node* add(std::string key, std::unique_ptr<Node> value);
};

/// Parses TOML 1.0 (toml++). Throws Error "NAME:LINE:COL: problem" for a syntax error and for input nested
/// deeper than kMaxDepth or holding more than kMaxValues values.
std::unique_ptr<Node> parse_toml(std::string_view text, const std::string& name);
/// Parses JSON (RFC 8259; duplicate keys are an error). Throws Error with the line and column of a syntax
/// error.
std::unique_ptr<Node> parse_json(std::string_view text, const std::string& name);

/// A kernel named for a (layer, device, mode).
struct ModeEntry {
  std::string mode;  ///< as written ("fallback" for the shorthand `device = "kernel"`)
  std::string kernel;
  bool shorthand = false;  ///< written as `device = "kernel"`
  Location mode_at;
  Location kernel_at;
};

struct DeviceEntry {
  std::string device;
  Location at;
  std::vector<ModeEntry> modes;
};

struct LayerEntry {
  std::string layer;
  Location at;
  std::vector<DeviceEntry> devices;
};

/// The keys as a JSON pointer ("/layer/device", '~' and '/' escaped); "(top level)" for none.
std::string json_pointer(const std::vector<std::string>& keys);

/// A mapping file after parsing and the shape check, names not yet checked against the registry.
struct ParsedMapping {
  std::string file;
  Format format = Format::kToml;
  std::vector<LayerEntry> layers;

  /// "FILE:LINE:COL" (TOML) or "FILE: /layer/device/mode" (JSON: the key path, as a JSON pointer).
  std::string where(Location at, const std::vector<std::string>& keys) const;
};

/// The version key: optional, at the top level, an integer; this reader understands version 1.
constexpr const char* kVersionKey = "kernmap_mapping";
constexpr int kVersion = 1;

/// Parses text in the given format and checks the document's shape. `name` is used in messages.
ParsedMapping parse_mapping_text(std::string_view text, Format format, const std::string& name);

/// Reads and parses a file (format by extension); refuses files over kMaxFileBytes, directories and
/// unreadable paths with an Error naming the file.
ParsedMapping read_mapping_file(const std::string& path);

}  // namespace kernmap::mapping_file
