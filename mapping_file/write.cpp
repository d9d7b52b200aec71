// Writing mapping files (kernmap/mapping_file.h): the text `kernmap tune` writes, in the shape the readers
// (mapping_file/json.cpp, toml.cpp, and Python's kernmap.load_mapping_file) take back.
#include <nlohmann/json.hpp>

#include <cstdio>
#include <string>
#include <vector>

#include "kernmap/mapping_file.h"
#include "mapping_file/format.h"
#include "repository/atomic_file.h"

namespace kernmap {
namespace {

namespace mf = mapping_file;

std::string toml_string(const std::string& text) {
  std::string out = "\"";
  for (const char c : text) {
    const auto u = static_cast<unsigned char>(c);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (u < 0x20 || u == 0x7f) {
      char escape[8];
      std::snprintf(escape, sizeof escape, "\\u%04x", u);
      out += escape;
    } else {
      out += c;
    }
  }
  return out + "\"";
}

// A TOML key: bare when it may be ("RMSNorm", "rotary_pos_emb"), else a basic string.
std::string toml_key(const std::string& key) {
  bool bare = !key.empty();
  for (const char c : key)
    bare = bare && ((c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_' ||
                    c == '-');
  return bare ? key : toml_string(key);
}

// A comment line holds no line break (it would end the comment and start a TOML line).
std::string comment(const std::string& line) {
  std::string out = "# ";
  for (const char c : line) out += c == '\n' || c == '\r' ? ' ' : c;
  return out;
}

}  // namespace

std::string mapping_file_text(const std::string& path, const std::vector<std::string>& header,
                              const std::vector<MappingFileSection>& sections) {
  mf::Format format;
  try {
    format = mf::format_of(path);
  } catch (const mf::Error& e) {
    throw MappingFileError(e.what());
  }
  if (format == mf::Format::kJson) {
    nlohmann::ordered_json doc = {{mf::kVersionKey, mf::kVersion}};
    for (const MappingFileSection& s : sections)
      for (const auto& [mode, kernel] : s.modes) doc[s.layer][s.device][to_string(mode)] = kernel;
    return doc.dump(2) + "\n";
  }
  std::string text;
  for (const std::string& line : header) text += comment(line) + "\n";
  text += std::string(mf::kVersionKey) + " = " + std::to_string(mf::kVersion) + "\n\n";
  for (const MappingFileSection& s : sections) {
    for (const std::string& line : s.comments) text += comment(line) + "\n";
    // Appended piece by piece: GCC 12 reports a false -Wrestrict on "[" + std::string&&.
    text += '[';
    text += toml_key(s.layer);
    text += '.';
    text += toml_key(s.device);
    text += "]\n";
    for (const auto& [mode, kernel] : s.modes)
      text += toml_key(to_string(mode)) + " = " + toml_string(kernel) + "\n";
    text += "\n";
  }
  return text;
}

void write_mapping_file(const std::string& path, const std::vector<std::string>& header,
                        const std::vector<MappingFileSection>& sections) {
  repository::write_file_atomically(path, mapping_file_text(path, header, sections));
}

}  // namespace kernmap
