// The TOML reader of mapping files: toml++ parses TOML 1.0 (every construct, and TOML's rules on defining a
// key or a table once); the document becomes a Node tree with each key's and value's location and each
// table's entries in file order. What the entries mean is the shape check's business (format.cpp), as for
// JSON.
//
// Untrusted text passes a prescan first (toml_prescan.h): toml++ 3.3 recurses once per nesting level while
// it parses and frees a document, and has undefined behaviour on some characters other than ASCII. Inline
// tables and arrays stop at TOML_MAX_NESTED_VALUES, kMaxDepth values deep; the prescan bounds dotted keys and
// table headers, and refuses those characters where toml++ would misread them.

// Compiled into this file, not linked from Debian's libtomlplusplus.so: the fuzz target instruments the
// parser, and libkernmap needs no other library at run time.
#define TOML_HEADER_ONLY 1
#define TOML_EXCEPTIONS 0  // errors come back in toml::parse_result
#define TOML_ENABLE_FORMATTERS 0
#define TOML_MAX_NESTED_VALUES 16
// toml++ 3.3 asserts internal conditions that malformed input can break (a table header such as "[[[a]]]",
// marzer/tomlplusplus#301; a date, a space and a digit), and with NDEBUG makes the same conditions compiler
// assumptions (undefined behaviour when broken, under clang). With neither it goes on to report such input as
// a syntax error: every build of this file parses that way, the fuzz target's included.
#define TOML_ASSERT(expr) static_assert(true)
#include <toml++/impl/preprocessor.h>
#undef TOML_ASSERT_ASSUME
#define TOML_ASSERT_ASSUME(expr) static_assert(true)
#include <toml++/toml.h>

#include <algorithm>
#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "mapping_file/format.h"
#include "mapping_file/toml_prescan.h"

namespace kernmap::mapping_file {
namespace {

static_assert(TOML_MAX_NESTED_VALUES == kMaxDepth, "toml++'s nesting limit is the mapping files' limit");

[[noreturn]] void fail(const std::string& name, Location at, const std::string& problem) {
  throw Error(name + ":" + std::to_string(at.line) + ":" + std::to_string(at.column) + ": " + problem);
}

Location location(const toml::source_region& region) {
  return Location{static_cast<int>(region.begin.line), static_cast<int>(region.begin.column)};
}

// toml++'s document as Nodes: depth and value count bounded as in JSON, tables in file order (toml++ keeps
// them sorted by key). A table made by a header or a dotted key is located at its key, an inline table or an
// array at its opening bracket.
class TreeBuilder {
 public:
  explicit TreeBuilder(const std::string& name) : name_(name) {}

  std::unique_ptr<Node> root(const toml::table& table) {
    auto node = make(Location{1, 1}, Location{1, 1});
    entries(*node, table, 1);
    return node;
  }

 private:
  std::unique_ptr<Node> make(Location key_at, Location value_at) {
    if (++values_ > kMaxValues) {
      fail(name_, value_at,
           "more than " + std::to_string(kMaxValues) + " values in one file (the limit for mapping files)");
    }
    auto node = std::make_unique<Node>();
    node->key_at = key_at;
    node->value_at = value_at;
    return node;
  }

  // depth: how many tables and arrays hold `value` (the root table is the first).
  std::unique_ptr<Node> value(const toml::node& value, Location key_at, int depth) {
    const toml::table* table = value.as_table();
    const toml::array* array = value.as_array();
    const bool container = table != nullptr || array != nullptr;
    const bool at_key = table != nullptr && !table->is_inline();
    if (container && depth + 1 > kMaxDepth) {
      fail(name_, at_key ? key_at : location(value.source()),
           "nested deeper than " + std::to_string(kMaxDepth) + " levels");
    }
    auto node = make(key_at, at_key ? key_at : location(value.source()));
    if (table != nullptr) {
      entries(*node, *table, depth + 1);
    } else if (array != nullptr) {
      node->kind = Node::Kind::kArray;
      for (std::size_t i = 0; i < array->size(); ++i) {
        const toml::node& element = *array->get(i);
        node->add(std::to_string(i), this->value(element, location(element.source()), depth + 1));
      }
    } else {
      scalar(*node, value);
    }
    return node;
  }

  void entries(Node& node, const toml::table& table, int depth) {
    node.kind = Node::Kind::kTable;
    std::vector<std::pair<const toml::key*, const toml::node*>> in_file_order;
    for (const auto& [key, value] : table) in_file_order.emplace_back(&key, &value);
    std::sort(in_file_order.begin(), in_file_order.end(), [](const auto& a, const auto& b) {
      const toml::source_position& pa = a.first->source().begin;
      const toml::source_position& pb = b.first->source().begin;
      return pa.line != pb.line ? pa.line < pb.line : pa.column < pb.column;
    });
    for (const auto& [key, value] : in_file_order)
      node.add(std::string(key->str()), this->value(*value, location(key->source()), depth));
  }

  static void scalar(Node& node, const toml::node& value) {
    switch (value.type()) {
      case toml::node_type::string:
        node.kind = Node::Kind::kString;
        node.text = value.as_string()->get();
        break;
      case toml::node_type::integer:
        node.kind = Node::Kind::kInteger;
        node.text = std::to_string(value.as_integer()->get());
        break;
      case toml::node_type::floating_point:
        node.kind = Node::Kind::kFloat;
        break;
      case toml::node_type::boolean:
        node.kind = Node::Kind::kBoolean;
        node.text = value.as_boolean()->get() ? "true" : "false";
        break;
      case toml::node_type::date:
        node.kind = Node::Kind::kDate;
        break;
      case toml::node_type::time:
        node.kind = Node::Kind::kTime;
        break;
      case toml::node_type::date_time:
        node.kind = Node::Kind::kDateTime;
        break;
      case toml::node_type::none:
      case toml::node_type::table:
      case toml::node_type::array:
        break;  // not scalars: value() handles containers, and a parsed document has no empty node
    }
  }

  const std::string& name_;
  std::size_t values_ = 0;
};

}  // namespace

std::unique_ptr<Node> parse_toml(std::string_view text, const std::string& name) {
  prescan_toml(text, name);
  const toml::parse_result result = toml::parse(text);
  if (!result)
    fail(name, location(result.error().source()),
         "invalid TOML: " + std::string(result.error().description()));
  return TreeBuilder(name).root(result.table());
}

}  // namespace kernmap::mapping_file
