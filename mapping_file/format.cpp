// Mapping files without the registry: the file, the format by extension, locations in messages, and the
// document's shape. The readers are json.cpp and toml.cpp.
#include "mapping_file/format.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <utility>

namespace kernmap::mapping_file {

Node* Node::find(const std::string& key) const {
  const auto it = index.find(key);
  return it == index.end() ? nullptr : items[it->second].second.get();
}

Node* Node::add(std::string key, std::unique_ptr<Node> value) {
  index.emplace(key, items.size());
  items.emplace_back(std::move(key), std::move(value));
  return items.back().second.get();
}

Format format_of(const std::string& path) {
  std::string ext = std::filesystem::path(path).extension().string();
  std::transform(ext.begin(), ext.end(), ext.begin(), [](unsigned char c) { return std::tolower(c); });
  if (ext == ".json") return Format::kJson;
  if (ext == ".toml") return Format::kToml;
  throw Error(path + ": unknown mapping file type '" + ext +
              "' (expected a file name ending in .json or .toml)");
}

std::string json_pointer(const std::vector<std::string>& keys) {
  if (keys.empty()) return "(top level)";
  std::string out;
  for (const std::string& key : keys) {
    out += '/';
    for (char c : key) {
      if (c == '~') {
        out += "~0";
      } else if (c == '/') {
        out += "~1";
      } else {
        out += c;
      }
    }
  }
  return out;
}

std::string ParsedMapping::where(Location at, const std::vector<std::string>& keys) const {
  if (format == Format::kToml) return file + ":" + std::to_string(at.line) + ":" + std::to_string(at.column);
  return file + ": " + json_pointer(keys);
}

namespace {

// The shape check: {layer: {device: kernel | {mode: kernel}}}, with the version key at the top.
class ShapeChecker {
 public:
  explicit ShapeChecker(ParsedMapping& out) : out_(out) {}

  void document(const Node& root) {
    if (root.kind != Node::Kind::kTable) {
      fail(root.value_at, {},
           "expected " + table_word() + " {layer: {device: ...}} at the top level, got " +
               kind_word(root.kind));
    }
    for (const auto& [name, node] : root.items) {
      if (name == kVersionKey) {
        version(*node);
        continue;
      }
      layer(name, *node);
    }
  }

 private:
  [[noreturn]] void fail(Location at, const std::vector<std::string>& keys,
                         const std::string& problem) const {
    throw Error(out_.where(at, keys) + ": " + problem);
  }

  bool toml() const { return out_.format == Format::kToml; }
  std::string table_word() const { return toml() ? "a table" : "an object"; }

  std::string kind_word(Node::Kind kind) const {
    switch (kind) {
      case Node::Kind::kTable:
        return toml() ? "a table" : "an object";
      case Node::Kind::kString:
        return "a string";
      case Node::Kind::kInteger:
        return toml() ? "an integer" : "a number";
      case Node::Kind::kFloat:
        return toml() ? "a float" : "a number";
      case Node::Kind::kBoolean:
        return "a boolean";
      case Node::Kind::kNull:
        return "null";
      case Node::Kind::kArray:
        return "an array";
      case Node::Kind::kDate:
        return "a date";
      case Node::Kind::kTime:
        return "a time";
      case Node::Kind::kDateTime:
        return "a date-time";
    }
    return "a value";
  }

  void version(const Node& node) {
    if (node.kind != Node::Kind::kInteger) {
      fail(node.value_at, {kVersionKey},
           std::string(kVersionKey) + " must be an integer (the format version, " + std::to_string(kVersion) +
               "), got " + kind_word(node.kind));
    }
    if (node.text != std::to_string(kVersion)) {
      fail(node.value_at, {kVersionKey},
           "mapping file format version " + node.text + " is not supported (this kernmap reads version " +
               std::to_string(kVersion) + ")");
    }
  }

  void layer(const std::string& name, const Node& node) {
    if (node.kind != Node::Kind::kTable) {
      fail(node.value_at, {name},
           "layer '" + name + "' must map to " + table_word() +
               " of devices ({device: kernel} or {device: {mode: kernel}}), got " + kind_word(node.kind));
    }
    LayerEntry entry{name, node.key_at, {}};
    for (const auto& [device_name, device] : node.items)
      entry.devices.push_back(this->device(name, device_name, *device));
    out_.layers.push_back(std::move(entry));
  }

  DeviceEntry device(const std::string& layer, const std::string& name, const Node& node) {
    DeviceEntry entry{name, node.key_at, {}};
    if (node.kind == Node::Kind::kString) {  // the shorthand: a device mapped straight to a kernel
      entry.modes.push_back(ModeEntry{"fallback", node.text, true, node.key_at, node.value_at});
      return entry;
    }
    if (node.kind != Node::Kind::kTable) {
      fail(node.value_at, {layer, name},
           "device '" + name + "' of layer '" + layer + "' must map to a kernel name (a string) or " +
               table_word() + " {mode: kernel}, got " + kind_word(node.kind));
    }
    for (const auto& [mode, kernel] : node.items) {
      if (kernel->kind != Node::Kind::kString) {
        fail(kernel->value_at, {layer, name, mode},
             "mode '" + mode + "' of layer '" + layer + "' on device '" + name +
                 "' must map to a kernel name (a string), got " + kind_word(kernel->kind));
      }
      entry.modes.push_back(ModeEntry{mode, kernel->text, false, kernel->key_at, kernel->value_at});
    }
    return entry;
  }

  ParsedMapping& out_;
};

}  // namespace

ParsedMapping parse_mapping_text(std::string_view text, Format format, const std::string& name) {
  ParsedMapping out;
  out.file = name;
  out.format = format;
  if (text.size() > kMaxFileBytes) {
    throw Error(name + ": the file is " + std::to_string(text.size()) + " bytes, more than the " +
                std::to_string(kMaxFileBytes) + "-byte limit for mapping files");
  }
  const std::unique_ptr<Node> root =
      format == Format::kToml ? parse_toml(text, name) : parse_json(text, name);
  ShapeChecker(out).document(*root);
  return out;
}

ParsedMapping read_mapping_file(const std::string& path) {
  const Format format = format_of(path);
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) throw Error(path + ": is a directory, not a mapping file");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(path + ": cannot open the mapping file: " + std::strerror(errno));
  std::string text;
  char buffer[65536];
  while (in.read(buffer, sizeof buffer) || in.gcount() > 0) {
    text.append(buffer, static_cast<std::size_t>(in.gcount()));
    if (text.size() > kMaxFileBytes) {
      throw Error(path + ": the file is larger than the " + std::to_string(kMaxFileBytes) +
                  "-byte limit for mapping files");
    }
  }
  if (in.bad()) throw Error(path + ": cannot read the mapping file: " + std::strerror(errno));
  return parse_mapping_text(text, format, path);
}

}  // namespace kernmap::mapping_file
