// What this CPU can execute, detected at run time (the extension itself is
// built for baseline x86-64 so that importing it never faults), and which
// instruction set the integer kernels use.
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

// The instruction sets the int8-activation kernels can run on: AVX2 (the
// baseline every native kernel needs) and AVX-512 with VNNI (F, BW, VL and
// VNNI, with the OS saving the zmm state). Both give bit-identical results.
enum class Isa : int { kAvx2 = 0, kAvx512Vnni = 1 };

// Whether the CPU (and OS) can run the AVX-512 VNNI kernels.
bool avx512_vnni_usable();

// The set the int8 kernels use now: MLX_LOOM_CPU_ISA (read once: "avx2" or
// "avx512"; unset or "auto" = the best this CPU has), or what set_isa chose
// last. Throws std::invalid_argument for an unknown name or a set this CPU
// lacks.
Isa active_isa();
std::string isa_name(Isa isa);

// Switch the set at run time (tests compare both paths in one process);
// "auto" = the best this CPU has. Returns the set now in use.
std::string set_isa(const std::string& name);

}  // namespace loom_cpu
