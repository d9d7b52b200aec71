// Mapping files without the registry: the file, the JSON parser (nlohmann's SAX interface, so that duplicate
// keys, nesting and size are checked as the text is read) and the document's shape.
#include "mapping_file/format.h"

#include <nlohmann/json.hpp>

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

namespace {

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

// Builds a Node tree from nlohmann's SAX events, refusing duplicate keys and deep or huge documents as they
// are read. Array elements are kept (keyed by index) only so that nesting inside them is counted.
class JsonBuilder {
 public:
  using json = nlohmann::json;

  explicit JsonBuilder(const std::string& name) : name_(name) {}

  std::unique_ptr<Node> root;
  std::string error;

  bool null() { return leaf(Node::Kind::kNull, ""); }
  bool boolean(bool v) { return leaf(Node::Kind::kBoolean, v ? "true" : "false"); }
  bool number_integer(json::number_integer_t v) { return leaf(Node::Kind::kInteger, std::to_string(v)); }
  bool number_unsigned(json::number_unsigned_t v) { return leaf(Node::Kind::kInteger, std::to_string(v)); }
  bool number_float(json::number_float_t /*value*/, const json::string_t& text) {
    return leaf(Node::Kind::kFloat, text);
  }
  bool string(json::string_t& v) { return leaf(Node::Kind::kString, v); }
  bool binary(json::binary_t& /*value*/) {
    return leaf(Node::Kind::kNull, "");
  }  // not produced by the JSON reader

  bool start_object(std::size_t /*elements*/) { return open(Node::Kind::kTable); }
  bool end_object() { return close(); }
  bool start_array(std::size_t /*elements*/) { return open(Node::Kind::kArray); }
  bool end_array() { return close(); }

  bool key(json::string_t& k) {
    Node* object = stack_.back();
    if (object->find(k) != nullptr) {
      path_.push_back(k);
      return refuse("duplicate key '" + k + "'");
    }
    pending_key_ = k;
    return true;
  }

  bool parse_error(std::size_t position, const std::string& /*last_token*/,
                   const nlohmann::detail::exception& e) {
    syntax_error_at = position;
    syntax_error = e.what();
    return false;
  }

  std::size_t syntax_error_at = 0;
  std::string syntax_error;

 private:
  bool refuse(const std::string& problem) {
    error = name_ + ": " + json_pointer(path_) + ": " + problem;
    return false;
  }

  // Places a new value: the root, an object member under the pending key, or the next array element.
  Node* place(std::unique_ptr<Node> node) {
    if (stack_.empty()) {
      root = std::move(node);
      return root.get();
    }
    Node* parent = stack_.back();
    std::string key =
        parent->kind == Node::Kind::kArray ? std::to_string(parent->items.size()) : pending_key_;
    return parent->add(std::move(key), std::move(node));
  }

  bool leaf(Node::Kind kind, std::string text) {
    if (++values_ > kMaxValues)
      return refuse("more than " + std::to_string(kMaxValues) + " values in one file");
    auto node = std::make_unique<Node>();
    node->kind = kind;
    node->text = std::move(text);
    place(std::move(node));
    return true;
  }

  bool open(Node::Kind kind) {
    if (!stack_.empty()) {
      const Node* parent = stack_.back();
      path_.push_back(parent->kind == Node::Kind::kArray ? std::to_string(parent->items.size())
                                                         : pending_key_);
    }
    if (static_cast<int>(stack_.size()) >= kMaxDepth) {
      return refuse("nested deeper than " + std::to_string(kMaxDepth) + " levels");
    }
    if (++values_ > kMaxValues)
      return refuse("more than " + std::to_string(kMaxValues) + " values in one file");
    auto node = std::make_unique<Node>();
    node->kind = kind;
    stack_.push_back(place(std::move(node)));
    return true;
  }

  bool close() {
    stack_.pop_back();
    if (!path_.empty() && !stack_.empty()) path_.pop_back();
    return true;
  }

  const std::string& name_;
  std::vector<Node*> stack_;
  std::vector<std::string> path_;  // keys of the open containers below the root
  std::string pending_key_;
  std::size_t values_ = 0;
};

// Line and column (in characters) of a byte offset.
Location location_of(std::string_view text, std::size_t offset) {
  Location at{1, 1};
  offset = std::min(offset, text.size());
  for (std::size_t i = 0; i < offset; ++i) {
    const auto c = static_cast<unsigned char>(text[i]);
    if (c == '\n') {
      ++at.line;
      at.column = 1;
    } else if ((c & 0xC0) != 0x80) {
      ++at.column;
    }
  }
  return at;
}

}  // namespace

std::unique_ptr<Node> parse_json(std::string_view text, const std::string& name) {
  JsonBuilder builder(name);
  const bool ok = nlohmann::json::sax_parse(text.begin(), text.end(), &builder);
  if (ok) return std::move(builder.root);
  if (!builder.error.empty()) throw Error(builder.error);
  // nlohmann reports the offset just past the offending character.
  const Location at = location_of(text, builder.syntax_error_at == 0 ? 0 : builder.syntax_error_at - 1);
  std::string message = builder.syntax_error;
  // "[json.exception.parse_error.101] parse error at line 1, column 5: syntax error ..." -> "syntax error
  // ..."
  if (const auto colon = message.find(": "); colon != std::string::npos) message = message.substr(colon + 2);
  throw Error(name + ":" + std::to_string(at.line) + ":" + std::to_string(at.column) +
              ": invalid JSON: " + message);
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
