// A strict parser for the TOML subset mapping files use (docs/mapping.md, "The TOML subset"): comments,
// [table] and [dotted.table] headers, bare/quoted/dotted keys, basic and literal one-line strings, inline
// tables, decimal integers and booleans (so that a wrong type is reported as such). Everything else TOML has
// (arrays, arrays of tables, multi-line strings, floats, dates) is refused with a message that names it, and
// TOML's rules on defining a key or table once are enforced. Nesting and value counts are bounded, so no
// input can exhaust the stack or memory.
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "mapping_file/format.h"

namespace kernmap::mapping_file {
namespace {

struct KeyPart {
  std::string name;
  Location at;
};

bool is_bare_key_char(char c) {
  return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_' || c == '-';
}

// A key as TOML would print it: bare when it can be, else quoted.
std::string display_key(const std::string& key) {
  bool bare = !key.empty();
  for (char c : key) bare = bare && is_bare_key_char(c);
  if (bare) return key;
  std::string out = "\"";
  for (unsigned char c : key) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c < 0x20 || c == 0x7f) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04X", c);
      out += buf;
    } else {
      out += static_cast<char>(c);
    }
  }
  return out + "\"";
}

std::string display_path(const std::vector<std::string>& keys) {
  std::string out;
  for (const std::string& k : keys) {
    if (!out.empty()) out += '.';
    out += display_key(k);
  }
  return out;
}

std::string describe_location(Location at) {
  return "line " + std::to_string(at.line) + ", column " + std::to_string(at.column);
}

// Checks that text is UTF-8 (TOML requires it); returns the byte offset of the first bad sequence, or npos.
std::size_t first_invalid_utf8(std::string_view text) {
  std::size_t i = 0;
  while (i < text.size()) {
    const auto c = static_cast<unsigned char>(text[i]);
    int extra = 0;
    uint32_t cp = 0;
    uint32_t min = 0;
    if (c < 0x80) {
      ++i;
      continue;
    } else if ((c & 0xE0) == 0xC0) {
      extra = 1, cp = c & 0x1F, min = 0x80;
    } else if ((c & 0xF0) == 0xE0) {
      extra = 2, cp = c & 0x0F, min = 0x800;
    } else if ((c & 0xF8) == 0xF0) {
      extra = 3, cp = c & 0x07, min = 0x10000;
    } else {
      return i;
    }
    if (i + extra >= text.size()) return i;
    for (int k = 1; k <= extra; ++k) {
      const auto d = static_cast<unsigned char>(text[i + k]);
      if ((d & 0xC0) != 0x80) return i;
      cp = (cp << 6) | (d & 0x3F);
    }
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return i;
    i += extra + 1;
  }
  return std::string_view::npos;
}

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

class Parser {
 public:
  Parser(std::string_view text, const std::string& name) : s_(text), name_(name) {}

  std::unique_ptr<Node> parse() {
    if (const std::size_t bad = first_invalid_utf8(s_); bad != std::string_view::npos) {
      while (pos_ < bad) advance();
      fail("the file is not valid UTF-8 (TOML files must be UTF-8)");
    }
    if (s_.substr(0, 3) == "\xEF\xBB\xBF") pos_ = 3;  // a byte-order mark is allowed, and is not a column
    auto root = std::make_unique<Node>();
    root->origin = Node::Origin::kHeader;
    root_ = root.get();
    current_ = root_;
    while (!at_end()) {
      skip_ws();
      if (at_end()) break;
      const char c = peek();
      if (c == '#' || c == '\n' || c == '\r') {
        end_of_line("");
      } else if (c == '[') {
        table_header();
      } else {
        key_value();
      }
    }
    return root;
  }

 private:
  [[noreturn]] void fail_at(Location at, const std::string& problem) const {
    throw Error(name_ + ":" + std::to_string(at.line) + ":" + std::to_string(at.column) + ": " + problem);
  }
  [[noreturn]] void fail(const std::string& problem) const { fail_at(here(), problem); }

  Location here() const { return Location{line_, column_}; }
  bool at_end() const { return pos_ >= s_.size(); }
  char peek(std::size_t ahead = 0) const { return pos_ + ahead < s_.size() ? s_[pos_ + ahead] : '\0'; }
  bool starts_with(std::string_view what) const { return s_.substr(pos_, what.size()) == what; }

  void advance() {
    const auto c = static_cast<unsigned char>(s_[pos_++]);
    if (c == '\n') {
      ++line_;
      column_ = 1;
    } else if ((c & 0xC0) != 0x80) {
      ++column_;  // UTF-8 continuation bytes belong to the character already counted
    }
  }

  void skip_ws() {
    while (!at_end() && (peek() == ' ' || peek() == '\t')) advance();
  }

  // What the parser sees at the current position, for messages.
  std::string seen() const {
    if (at_end()) return "end of file";
    const auto c = static_cast<unsigned char>(peek());
    if (c == '\n' || (c == '\r' && peek(1) == '\n')) return "end of line";
    if (c < 0x20 || c == 0x7f) {
      char buf[16];
      std::snprintf(buf, sizeof buf, "U+%04X", c);
      std::string out = "control character ";
      out += buf;
      return out;
    }
    std::size_t n = 1;
    if (c >= 0x80) n = (c & 0xE0) == 0xC0 ? 2 : (c & 0xF0) == 0xE0 ? 3 : 4;
    std::string out = "'";
    out.append(s_.substr(pos_, n));
    out += '\'';
    return out;
  }

  void check_control(const char* where) const {
    const auto c = static_cast<unsigned char>(peek());
    if ((c < 0x20 && c != '\t') || c == 0x7f) {
      fail(seen() + " in " + where + " (control characters other than tab are not allowed)");
    }
  }

  // After a statement: optional whitespace and comment, then a newline or the end of the file.
  void end_of_line(const std::string& after) {
    skip_ws();
    if (peek() == '#') {
      while (!at_end() && peek() != '\n') {
        if (peek() == '\r' && peek(1) == '\n') break;
        check_control("a comment");
        advance();
      }
    }
    if (at_end()) return;
    if (peek() == '\n') {
      advance();
      return;
    }
    if (peek() == '\r') {
      if (peek(1) == '\n') {
        advance();
        advance();
        return;
      }
      fail("carriage return without a line feed (lines end with LF or CRLF)");
    }
    fail("expected the end of the line" + after + ", got " + seen());
  }

  void count_value() {
    if (++values_ > kMaxValues) {
      fail("more than " + std::to_string(kMaxValues) + " values in one file (the limit for mapping files)");
    }
  }

  // --- keys ---

  std::vector<KeyPart> key() {
    std::vector<KeyPart> parts;
    for (;;) {
      skip_ws();
      parts.push_back(simple_key());
      skip_ws();
      if (peek() != '.') break;
      advance();
    }
    return parts;
  }

  KeyPart simple_key() {
    KeyPart part{"", here()};
    const char c = peek();
    if (c == '"') {
      part.name = basic_string();
    } else if (c == '\'') {
      part.name = literal_string();
    } else if (is_bare_key_char(c)) {
      while (!at_end() && is_bare_key_char(peek())) {
        part.name += peek();
        advance();
      }
    } else {
      fail("expected a key (letters, digits, '_', '-', or a quoted string), got " + seen());
    }
    return part;
  }

  // --- strings ---

  std::string basic_string() {
    const Location start = here();
    if (starts_with("\"\"\"")) fail("multi-line strings (\"\"\") are not supported in mapping files");
    advance();
    std::string out;
    for (;;) {
      if (at_end() || peek() == '\n' || peek() == '\r') {
        fail_at(start, "unterminated string (a string must end with '\"' on the same line)");
      }
      const char c = peek();
      if (c == '"') {
        advance();
        return out;
      }
      if (c == '\\') {
        escape(out);
        continue;
      }
      check_control("a string");
      out += c;
      advance();
    }
  }

  void escape(std::string& out) {
    const Location at = here();
    advance();  // the backslash
    const char c = peek();
    const char* simple = nullptr;
    switch (c) {
      case 'b':
        simple = "\b";
        break;
      case 't':
        simple = "\t";
        break;
      case 'n':
        simple = "\n";
        break;
      case 'f':
        simple = "\f";
        break;
      case 'r':
        simple = "\r";
        break;
      case '"':
        simple = "\"";
        break;
      case '\\':
        simple = "\\";
        break;
      default:
        break;
    }
    if (simple != nullptr) {
      out += simple;
      advance();
      return;
    }
    if (c == 'u' || c == 'U') {
      const int digits = c == 'u' ? 4 : 8;
      advance();
      uint32_t cp = 0;
      for (int i = 0; i < digits; ++i) {
        const char h = peek();
        int v = -1;
        if (h >= '0' && h <= '9') v = h - '0';
        if (h >= 'a' && h <= 'f') v = h - 'a' + 10;
        if (h >= 'A' && h <= 'F') v = h - 'A' + 10;
        if (v < 0) {
          fail_at(at, std::string("invalid escape: \\") + c + " needs " + std::to_string(digits) +
                          " hexadecimal digits");
        }
        cp = cp * 16 + static_cast<uint32_t>(v);
        advance();
      }
      if (cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) {
        char buf[16];
        std::snprintf(buf, sizeof buf, "U+%X", cp);
        fail_at(at, std::string("invalid escape: ") + buf + " is not a Unicode scalar value");
      }
      append_utf8(out, cp);
      return;
    }
    fail_at(at, "invalid escape '\\" + (at_end() || c == '\n' ? std::string() : std::string(1, c)) +
                    "' (valid: \\b \\t \\n \\f \\r \\\" \\\\ \\uXXXX \\UXXXXXXXX)");
  }

  std::string literal_string() {
    const Location start = here();
    if (starts_with("'''")) fail("multi-line strings (''') are not supported in mapping files");
    advance();
    std::string out;
    for (;;) {
      if (at_end() || peek() == '\n' || peek() == '\r') {
        fail_at(start, "unterminated string (a literal string must end with \"'\" on the same line)");
      }
      if (peek() == '\'') {
        advance();
        return out;
      }
      check_control("a string");
      out += peek();
      advance();
    }
  }

  // --- values ---

  std::unique_ptr<Node> value(int depth) {
    count_value();
    auto node = std::make_unique<Node>();
    node->value_at = here();
    const char c = peek();
    if (c == '"' || c == '\'') {
      node->kind = Node::Kind::kString;
      node->text = c == '"' ? basic_string() : literal_string();
    } else if (c == '{') {
      inline_table(*node, depth);
    } else if (c == '[') {
      fail("arrays are not supported in mapping files (a value is a \"kernel\" string or a { table })");
    } else if ((c >= '0' && c <= '9') || c == '+' || c == '-' || (c >= 'a' && c <= 'z')) {
      scalar(*node);
    } else {
      fail("expected a value (a \"string\", a 'string' or an { inline table }), got " + seen());
    }
    return node;
  }

  // A bare token: true/false, a decimal integer; other TOML scalars are named and refused.
  void scalar(Node& node) {
    const Location at = here();
    std::string token;
    while (!at_end()) {
      const char c = peek();
      const bool part = is_bare_key_char(c) || c == '+' || c == '.' || c == ':';
      if (!part && !(c == ' ' && token.size() == 10 && token[4] == '-')) break;  // "1979-05-27 07:32:00"
      token += c;
      advance();
    }
    if (token == "true" || token == "false") {
      node.kind = Node::Kind::kBoolean;
      node.text = token;
      return;
    }
    std::string_view digits = token;
    if (!digits.empty() && (digits[0] == '+' || digits[0] == '-')) digits.remove_prefix(1);
    bool all_digits = !digits.empty();
    for (char d : digits) all_digits = all_digits && d >= '0' && d <= '9';
    if (all_digits) {
      if (digits.size() > 1 && digits[0] == '0')
        fail_at(at, "leading zeros are not allowed in integer " + token);
      if (digits.size() > 18) fail_at(at, "integer " + token + " is out of range");
      node.kind = Node::Kind::kInteger;
      node.text = token[0] == '+' ? token.substr(1) : token;
      if (node.text == "-0") node.text = "0";
      return;
    }
    if (token.find(':') != std::string::npos ||
        (token.size() >= 10 && token[4] == '-' && token[0] >= '0' && token[0] <= '9')) {
      fail_at(at, "dates and times are not supported in mapping files (" + token + ")");
    }
    if (digits.size() > 1 && digits[0] == '0' && (digits[1] == 'x' || digits[1] == 'o' || digits[1] == 'b')) {
      fail_at(at,
              "hexadecimal, octal and binary integers are not supported in mapping files (" + token + ")");
    }
    const bool numeric = !digits.empty() && digits[0] >= '0' && digits[0] <= '9';
    if (digits == "inf" || digits == "nan" || (numeric && token.find_first_of(".eE") != std::string::npos)) {
      fail_at(at, "floats are not supported in mapping files (" + token + ")");
    }
    if (numeric && token.find('_') != std::string::npos) {
      fail_at(at, "underscores in numbers are not supported in mapping files (" + token + ")");
    }
    if (!numeric && token[0] != '+' && token[0] != '-') {
      fail_at(at, "expected a value, got the bare word '" + token + "' (strings must be in quotes: \"" +
                      token + "\")");
    }
    fail_at(at, "invalid value '" + token + "' (a value is a \"string\", a 'string' or an { inline table })");
  }

  void inline_table(Node& table, int depth) {
    if (depth > kMaxDepth) fail("tables nested deeper than " + std::to_string(kMaxDepth) + " levels");
    table.kind = Node::Kind::kTable;
    table.origin = Node::Origin::kInline;
    advance();  // {
    skip_ws();
    if (peek() == '}') {
      advance();
      return;
    }
    for (;;) {
      const std::vector<KeyPart> keys = key();
      expect_equals(keys);
      skip_ws();
      std::unique_ptr<Node> v = value(depth + static_cast<int>(keys.size()));
      insert(table, {}, keys, std::move(v), depth);
      skip_ws();
      if (peek() == ',') {
        advance();
        skip_ws();
        if (peek() == '}') fail("trailing comma in an inline table (TOML does not allow one)");
        continue;
      }
      if (peek() == '}') {
        advance();
        return;
      }
      if (at_end() || peek() == '\n' || peek() == '\r') {
        fail("unterminated inline table (an inline table must end with '}' on the same line)");
      }
      fail("expected ',' or '}' in an inline table, got " + seen());
    }
  }

  void expect_equals(const std::vector<KeyPart>& keys) {
    skip_ws();
    if (peek() != '=') {
      std::vector<std::string> names;
      for (const KeyPart& k : keys) names.push_back(k.name);
      fail("expected '=' after the key " + display_path(names) + ", got " + seen());
    }
    advance();
  }

  // --- statements ---

  // Puts value under `keys` (dotted) in table, whose path (for messages) is `prefix`. Tables on the way may
  // be created here, or have been created by dotted keys in this same table; nothing else can be extended.
  void insert(Node& table, std::vector<std::string> prefix, const std::vector<KeyPart>& keys,
              std::unique_ptr<Node> value, int depth) {
    if (depth + static_cast<int>(keys.size()) > kMaxDepth) {
      fail_at(keys.back().at, "keys nested deeper than " + std::to_string(kMaxDepth) + " levels");
    }
    Node* at = &table;
    for (std::size_t i = 0; i + 1 < keys.size(); ++i) {
      prefix.push_back(keys[i].name);
      Node* next = at->find(keys[i].name);
      if (next == nullptr) {
        count_value();
        auto created = std::make_unique<Node>();
        created->origin = Node::Origin::kDotted;
        created->key_at = created->value_at = keys[i].at;
        next = at->add(keys[i].name, std::move(created));
      } else if (next->kind != Node::Kind::kTable) {
        fail_at(keys[i].at, "key " + display_path(prefix) + " already has a value (at " +
                                describe_location(next->key_at) + "), so it cannot hold keys");
      } else if (next->origin != Node::Origin::kDotted) {
        fail_at(keys[i].at, "table " + display_path(prefix) + " is defined at " +
                                describe_location(next->value_at) + "; keys cannot be added to it from here");
      }
      at = next;
    }
    const KeyPart& last = keys.back();
    prefix.push_back(last.name);
    if (const Node* existing = at->find(last.name)) {
      fail_at(last.at, "duplicate key " + display_path(prefix) + " (first defined at " +
                           describe_location(existing->key_at) + ")");
    }
    value->key_at = last.at;
    at->add(last.name, std::move(value));
  }

  void table_header() {
    const Location start = here();
    if (starts_with("[[")) fail("arrays of tables ([[...]]) are not supported in mapping files");
    advance();  // [
    const std::vector<KeyPart> keys = key();
    if (peek() != ']') fail("expected ']' to close the table header, got " + seen());
    advance();
    if (static_cast<int>(keys.size()) > kMaxDepth) {
      fail_at(start, "table headers nested deeper than " + std::to_string(kMaxDepth) + " levels");
    }
    std::vector<std::string> path;
    Node* at = root_;
    for (std::size_t i = 0; i < keys.size(); ++i) {
      path.push_back(keys[i].name);
      const bool last = i + 1 == keys.size();
      Node* next = at->find(keys[i].name);
      if (next == nullptr) {
        count_value();
        auto created = std::make_unique<Node>();
        created->origin = last ? Node::Origin::kHeader : Node::Origin::kImplicit;
        created->key_at = created->value_at = keys[i].at;
        next = at->add(keys[i].name, std::move(created));
      } else if (next->kind != Node::Kind::kTable) {
        fail_at(keys[i].at, "key " + display_path(path) + " already has a value (at " +
                                describe_location(next->key_at) + "), so it cannot be a table");
      } else if (next->origin == Node::Origin::kInline) {
        fail_at(keys[i].at, "table " + display_path(path) + " is an inline table (at " +
                                describe_location(next->value_at) + ") and cannot be extended");
      } else if (last) {
        if (next->origin != Node::Origin::kImplicit) {
          fail_at(start, "table [" + display_path(path) + "] is already defined (at " +
                             describe_location(next->value_at) + ")");
        }
        next->origin = Node::Origin::kHeader;
        next->value_at = keys[i].at;
      }
      at = next;
    }
    current_ = at;
    current_path_ = std::move(path);
    end_of_line(" after the table header");
  }

  void key_value() {
    const std::vector<KeyPart> keys = key();
    expect_equals(keys);
    skip_ws();
    const int depth = static_cast<int>(current_path_.size());
    std::unique_ptr<Node> v = value(depth + static_cast<int>(keys.size()));
    insert(*current_, current_path_, keys, std::move(v), depth);
    end_of_line(" after the value");
  }

  std::string_view s_;
  const std::string& name_;
  std::size_t pos_ = 0;
  int line_ = 1;
  int column_ = 1;
  std::size_t values_ = 0;
  Node* root_ = nullptr;
  Node* current_ = nullptr;
  std::vector<std::string> current_path_;
};

}  // namespace

std::unique_ptr<Node> parse_toml(std::string_view text, const std::string& name) {
  return Parser(text, name).parse();
}

}  // namespace kernmap::mapping_file
