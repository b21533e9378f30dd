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
// "avx512"; unset or "auto" = the best this CPU has, at each row count as
// one_row_avx512 says), or what set_isa chose
// last. Throws std::invalid_argument for an unknown name or a set this CPU
// lacks.
Isa active_isa();
std::string isa_name(Isa isa);

// Whether one activation row's int8 products (single-stream decode) run on
// AVX-512 where the set in use is AVX-512: always when the set was named
// avx512 (MLX_LOOM_CPU_ISA or set_isa), else the rule one_row_avx512_for
// applied to this CPU's vendor and family (read once).
bool one_row_avx512();

// The rule itself, as data: with one activation row the AVX-512 kernel
// transposes every block of sixteen weight rows for that row alone, and
// whether that beats the AVX2 kernel's rows read in order depends on how
// wide the core's vector units are. On AMD Zen 5 (family 0x1A, 512-bit
// units) it does; on Zen 4 (0x19, 512-bit operations split in two) and
// on the Intel Xeons measured it does not. Both kernels give the same
// bits, so the rule only moves time.
bool one_row_avx512_for(const std::string& vendor, int family);

// Switch the set at run time (tests compare both paths in one process);
// "auto" = the best this CPU has. Returns the set now in use.
std::string set_isa(const std::string& name);

}  // namespace loom_cpu
