// The JSON reader of mapping files: nlohmann's SAX interface, so that duplicate keys, nesting and size are
// checked as the text is read.
#include <nlohmann/json.hpp>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "mapping_file/format.h"

namespace kernmap::mapping_file {
namespace {

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
  // nlohmann takes a NUL byte for the end of its input, so "{...}\0anything" would parse as "{...}". JSON
  // text holds no raw NUL (in a string it is spelled \u0000), so one anywhere is refused before parsing.
  if (const size_t nul = text.find('\0'); nul != std::string_view::npos) {
    const Location at = location_of(text, nul);
    throw Error(name + ":" + std::to_string(at.line) + ":" + std::to_string(at.column) +
                ": a NUL byte (offset " + std::to_string(nul) + "; JSON text cannot hold one)");
  }
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

}  // namespace kernmap::mapping_file
