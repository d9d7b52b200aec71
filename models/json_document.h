// Untrusted JSON text parsed as one whole document (torch-free: also compiled into the fuzz targets).
// nlohmann::json (3.11) takes a NUL byte for the end of its input, so "{...}\0anything" parses as "{...}" and
// the rest is silently ignored. JSON text holds no raw NUL byte (inside a string it is spelled \u0000,
// outside one it is no token), so a NUL anywhere is refused before parsing.
#pragma once

#include <nlohmann/json.hpp>

#include <stdexcept>
#include <string>
#include <string_view>

namespace kernmap::json_document {

/// Text that is not one JSON document: the message says where and why.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// The JSON document that is the whole of text. Throws Error naming the offset of a NUL byte, or with
/// nlohmann's message for invalid JSON; what `callback` throws passes through unchanged.
inline nlohmann::json parse(std::string_view text,
                            const nlohmann::json::parser_callback_t& callback = nullptr) {
  if (const size_t nul = text.find('\0'); nul != std::string_view::npos)
    throw Error("a NUL byte at offset " + std::to_string(nul) + " (JSON text cannot hold one)");
  try {
    return nlohmann::json::parse(text.begin(), text.end(), callback);
  } catch (const nlohmann::json::exception& e) {
    throw Error(e.what());
  }
}

}  // namespace kernmap::json_document
