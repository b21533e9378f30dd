// What this CPU can execute, detected at run time (the extension itself is
// built for baseline x86-64 so that importing it never faults).
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace loom_cpu {

// (instruction set, present) for every set the kernels use or could use.
std::vector<std::pair<std::string, bool>> cpu_features();

// The instruction sets the native kernels need and this CPU lacks, comma
// separated; empty when they can run.
std::string missing_instructions();

}  // namespace loom_cpu
