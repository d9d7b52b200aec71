// The prescan of TOML text (toml_prescan.h). It reads only what the guards need, as toml++ reads it: strings
// ("..." and '...' end at their quote or the line's end; """...""" and '''...''' at the closing delimiter
// plus up to two more quotes, content in TOML, possibly lines later; a backslash in a basic string escapes
// the next character), comments, and where a quote begins a string (not in a word of a value: see
// starts_word and structure()). That reading is exact for text that is TOML so far, and toml++ stops at its
// first error, reading ahead at most to the end of the word it fails on, so a misreading after invalid text
// cannot let through what toml++ would reach.
#include "mapping_file/toml_prescan.h"

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>
#include <vector>

#include "mapping_file/format.h"

namespace kernmap::mapping_file {
namespace {

bool blank(char c) {
  return c == ' ' || c == '\t';
}
bool ascii(char c) {
  return static_cast<unsigned char>(c) < 0x80;
}
// A value that is not a string, array or inline table is a word to toml++: it reads on to the next blank,
// line end, ']', '}', ',' or '#', quotes and brackets included.
bool ends_word(char c) {
  return blank(c) || c == '\n' || c == '\r' || c == ']' || c == '}' || c == ',' || c == '#';
}
bool starts_word(char c) {
  return !ends_word(c) && c != '"' && c != '\'' && c != '[' && c != '{';
}

class Prescan {
 public:
  Prescan(std::string_view text, const std::string& name) : s_(text), name_(name) {}

  void run() {
    if (s_.substr(0, 3) == "\xEF\xBB\xBF") pos_ = line_start_ = 3;  // a byte-order mark is not a column
    while (pos_ < s_.size()) {
      const char c = s_[pos_];
      if (word_ && ends_word(c)) word_ = false;
      if (c == '#') {
        while (pos_ < s_.size() && s_[pos_] != '\n') ++pos_;
        continue;
      }
      if (!word_ && value_ && starts_word(c)) word_ = true;
      if (!word_ && (c == '"' || c == '\'')) {
        string(c);
        continue;
      }
      if (!ascii(c)) {
        fail(pos_, "invalid TOML: " + character(pos_) +
                       " outside strings and comments (keys and values other than strings are ASCII)");
      }
      if (c == '.' && ++dots_ > kMaxLineDots) {
        fail(pos_, "more than " + std::to_string(kMaxLineDots) +
                       " dots outside strings and comments on one line (mapping files nest " +
                       std::to_string(kMaxDepth) + " levels at most)");
      }
      if (!word_) structure(c);
      step();
    }
  }

 private:
  [[noreturn]] void fail(std::size_t offset, const std::string& problem) const {
    int column = 1;
    for (std::size_t i = line_start_; i < offset; ++i)
      column += (static_cast<unsigned char>(s_[i]) & 0xC0) != 0x80;
    throw Error(name_ + ":" + std::to_string(line_) + ":" + std::to_string(column) + ": " + problem);
  }

  // Whether a value or a key comes next, as far as quotes need it: a value after '=', after an array's '['
  // or ',' and on an array's next line; a key at a line's start, after a header's '[' and after an inline
  // table's '{' or ','.
  void structure(char c) {
    switch (c) {
      case '\n':
        if (frames_.empty() || frames_.back() != kArray) value_ = false;
        break;
      case '=':
        value_ = true;
        break;
      case '[':
        frames_.push_back(value_ ? kArray : kHeader);
        break;
      case ']':
        if (!frames_.empty() && frames_.back() == kHeader) value_ = false;
        if (!frames_.empty()) frames_.pop_back();
        break;
      case '{':
        frames_.push_back(kTable);
        value_ = false;
        break;
      case '}':
        if (!frames_.empty()) frames_.pop_back();
        value_ = true;
        break;
      case ',':
        value_ = !frames_.empty() && frames_.back() == kArray;
        break;
      default:
        break;
    }
  }

  // One character forward, keeping the line count.
  void step() {
    if (s_[pos_++] != '\n') return;
    ++line_;
    line_start_ = pos_;
    dots_ = 0;
  }

  // "'é' (U+00E9)" for the UTF-8 character at offset i, "byte 0xFF" where no character starts.
  std::string character(std::size_t i) const {
    const auto lead = static_cast<unsigned char>(s_[i]);
    const std::size_t n = lead >= 0xF0 && lead < 0xF8 ? 4 : lead >= 0xE0 ? 3 : lead >= 0xC0 ? 2 : 0;
    uint32_t code = lead & (0x7F >> n);
    bool ok = n > 0 && i + n <= s_.size();
    for (std::size_t k = 1; ok && k < n; ++k) {
      const auto next = static_cast<unsigned char>(s_[i + k]);
      ok = (next & 0xC0) == 0x80;
      code = code << 6 | (next & 0x3F);
    }
    char text[32];
    if (!ok) {
      std::snprintf(text, sizeof text, "byte 0x%02X", lead);
      return text;
    }
    std::snprintf(text, sizeof text, "' (U+%04X)", static_cast<unsigned>(code));
    return std::string(1, '\'').append(s_.substr(i, n)).append(text);
  }

  void string(char quote) {
    const std::string delimiter(3, quote);
    if (s_.compare(pos_, 3, delimiter) != 0) {
      for (++pos_; pos_ < s_.size() && s_[pos_] != '\n'; ++pos_) {
        if (s_[pos_] == quote) {
          ++pos_;
          return;
        }
        if (quote == '"' && s_[pos_] == '\\' && pos_ + 1 < s_.size() && s_[pos_ + 1] != '\n') ++pos_;
      }
      return;
    }
    pos_ += 3;
    while (pos_ < s_.size()) {
      if (s_.compare(pos_, 3, delimiter) == 0) {
        pos_ += 3;
        for (int extra = 0; extra < 2 && pos_ < s_.size() && s_[pos_] == quote; ++extra) ++pos_;
        return;
      }
      if (quote == '"' && s_[pos_] == '\\') {
        ++pos_;
        escape();
      } else {
        step();
      }
    }
  }

  // After a backslash in a multi-line basic string: an escaped character (consumed), or a line-ending
  // backslash, whose blanks and line ends toml++ skips (so are we). The character it then tests is checked.
  void escape() {
    if (pos_ >= s_.size()) return;
    const char c = s_[pos_];
    if (ascii(c) && !blank(c) && c != '\r' && c != '\n') {
      ++pos_;
      return;
    }
    if (ascii(c)) {
      while (pos_ < s_.size() && (blank(s_[pos_]) || s_[pos_] == '\r')) ++pos_;
      if (pos_ < s_.size() && s_[pos_] == '\n') {
        while (pos_ < s_.size() && (blank(s_[pos_]) || s_[pos_] == '\r' || s_[pos_] == '\n')) step();
      }
    }
    if (pos_ < s_.size() && !ascii(s_[pos_])) {
      fail(pos_,
           character(pos_) +
               " after a backslash in a multi-line string: kernmap's TOML reader (toml++ 3.3) cannot take "
               "it there (write it as a \\u escape)");
    }
  }

  std::string_view s_;
  const std::string& name_;
  std::size_t pos_ = 0;
  std::size_t line_start_ = 0;
  int line_ = 1;
  int dots_ = 0;
  enum Frame : char { kArray, kHeader, kTable };
  std::vector<Frame> frames_;  // the open brackets: arrays, table headers, inline tables
  bool value_ = false;         // a value comes next, or is being read
  bool word_ = false;          // in a word of a value (see starts_word)
};

}  // namespace

void prescan_toml(std::string_view text, const std::string& name) {
  Prescan(text, name).run();
}

}  // namespace kernmap::mapping_file
