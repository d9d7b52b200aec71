// Internal: the machine facts tune records (layers/tune_file.cpp), for tune() (layers/tune.cpp).
#pragma once

#include <string>

#include "kernmap/tune.h"

namespace kernmap {

/// Host, CPU and its levels, threads, library versions and the time now (UTC), as Python's _tune.machine.
TuneMachine tune_machine(const std::string& device);

}  // namespace kernmap
