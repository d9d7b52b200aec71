// The exception boundary of the C API (capi/guarded.h).
#include "capi/guarded.h"

#include <nlohmann/json.hpp>

#include <stdexcept>
#include <string>

#include "kernmap/c_api.h"
#include "repository/json_forms.h"

namespace kernmap::detail {

int guarded_call(const char* function, char** error, const std::function<void()>& body,
                 bool name_invalid_argument) {
  const auto fail = [&](int status, const std::string& message) {
    if (error != nullptr) *error = copy_string(message);
    return status;
  };
  try {
    body();
    return KERNMAP_OK;
  } catch (const std::invalid_argument& e) {
    return fail(KERNMAP_INVALID_ARGUMENT,
                name_invalid_argument ? std::string(function) + ": " + e.what() : e.what());
  } catch (const nlohmann::json::exception& e) {
    return fail(KERNMAP_INVALID_ARGUMENT, std::string(function) + ": invalid JSON argument: " + e.what());
  } catch (const std::exception& e) {
    return fail(KERNMAP_INTERNAL_ERROR, std::string(function) + ": " + e.what());
  } catch (...) {
    return fail(KERNMAP_INTERNAL_ERROR, std::string(function) + ": unknown error");
  }
}

}  // namespace kernmap::detail
