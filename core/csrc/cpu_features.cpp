#include "cpu_features.h"

#include "kernels.h"

#include <cpuid.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

namespace loom_cpu {

namespace {

// AVX-512 F, BW, VL and VNNI from cpuid leaf 7, and the OS's consent from
// XCR0: the opmask, upper-zmm and hi16-zmm state (bits 5-7) besides the
// SSE and AVX state (bits 1-2). __builtin_cpu_supports checks the same for
// each flag; reading them here keeps the rule in one place.
struct Avx512 {
  bool f = false;
  bool bw = false;
  bool vl = false;
  bool vnni = false;
  bool avx_vnni = false;
  bool os_zmm = false;
};

Avx512 detect() {
  Avx512 a;
  unsigned eax, ebx, ecx, edx;
  if (__get_cpuid(1, &eax, &ebx, &ecx, &edx) == 0) {
    return a;
  }
  const bool osxsave = (ecx & (1u << 27)) != 0;
  if (!osxsave || __get_cpuid_max(0, nullptr) < 7) {
    return a;
  }
  unsigned xlo, xhi;
  __asm__ volatile("xgetbv" : "=a"(xlo), "=d"(xhi) : "c"(0));
  const bool os_ymm = (xlo & 0x6u) == 0x6u;
  a.os_zmm = os_ymm && (xlo & 0xE0u) == 0xE0u;
  __cpuid_count(7, 0, eax, ebx, ecx, edx);
  a.f = (ebx & (1u << 16)) != 0;
  a.bw = (ebx & (1u << 30)) != 0;
  a.vl = (ebx & (1u << 31)) != 0;
  a.vnni = (ecx & (1u << 11)) != 0;
  __cpuid_count(7, 1, eax, ebx, ecx, edx);
  a.avx_vnni = os_ymm && (eax & (1u << 4)) != 0;
  return a;
}

// The vendor string of cpuid leaf 0 and the display family of leaf 1
// (the base family, plus the extended family where the base is 0xF).
struct Identity {
  std::string vendor;
  int family = 0;
};

Identity identify() {
  Identity id;
  unsigned eax, ebx, ecx, edx;
  if (__get_cpuid(0, &eax, &ebx, &ecx, &edx) == 0) {
    return id;
  }
  char name[13];
  std::memcpy(name, &ebx, 4);
  std::memcpy(name + 4, &edx, 4);
  std::memcpy(name + 8, &ecx, 4);
  name[12] = '\0';
  id.vendor = name;
  if (__get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0) {
    const int base = static_cast<int>((eax >> 8) & 0xF);
    id.family = base == 0xF ? base + static_cast<int>((eax >> 20) & 0xFF) : base;
  }
  return id;
}

const Avx512& avx512() {
  static const Avx512 a = detect();
  return a;
}

Isa best_isa() {
  return avx512_vnni_usable() ? Isa::kAvx512Vnni : Isa::kAvx2;
}

Isa parse(const std::string& name, const char* source) {
  if (name.empty() || name == "auto") {
    return best_isa();
  }
  if (name == "avx2") {
    return Isa::kAvx2;
  }
  if (name == "avx512") {
    if (!avx512_vnni_usable()) {
      throw std::invalid_argument(
          std::string("[loom native kernels] ") + source +
          " asks for avx512, but this CPU (or its OS) lacks AVX-512 F/BW/VL with VNNI; use "
          "avx2 or auto.");
    }
    return Isa::kAvx512Vnni;
  }
  throw std::invalid_argument(
      std::string("[loom native kernels] ") + source + " is '" + name +
      "'; it must be auto, avx2 or avx512.");
}

// -1: not chosen yet (the first use reads MLX_LOOM_CPU_ISA); else the Isa,
// plus kNamed when the name was avx512 itself (then one row runs it too).
constexpr int kNamed = 2;
std::atomic<int> chosen{-1};

int choice(const std::string& name, const char* source) {
  const Isa isa = parse(name, source);
  return static_cast<int>(isa) + (name == "avx512" ? kNamed : 0);
}

int chosen_now() {
  int v = chosen.load(std::memory_order_relaxed);
  if (v < 0) {
    const char* env = std::getenv("MLX_LOOM_CPU_ISA");
    v = choice(env != nullptr ? env : "", "MLX_LOOM_CPU_ISA");
    chosen.store(v, std::memory_order_relaxed);
  }
  return v;
}

}  // namespace

std::vector<std::pair<std::string, bool>> cpu_features() {
  __builtin_cpu_init();
  const Avx512& a = avx512();
  // __builtin_cpu_supports also checks that the OS saves the AVX state.
  return {
      {"avx2", static_cast<bool>(__builtin_cpu_supports("avx2"))},
      {"fma", static_cast<bool>(__builtin_cpu_supports("fma"))},
      {"f16c", static_cast<bool>(__builtin_cpu_supports("f16c"))},
      {"avx512f", a.f && a.os_zmm},
      {"avx512bw", a.bw && a.os_zmm},
      {"avx512vl", a.vl && a.os_zmm},
      {"avx512vnni", a.vnni && a.os_zmm},
      {"avxvnni", a.avx_vnni},
  };
}

std::string missing_instructions() {
  std::string missing;
  for (const auto& [name, present] : cpu_features()) {
    if (name.rfind("avx512", 0) == 0 || name == "avxvnni") {
      continue;  // optional: used when present, AVX2 otherwise
    }
    if (!present) {
      missing += (missing.empty() ? "" : ", ") + name;
    }
  }
  return missing;
}

bool avx512_vnni_usable() {
  const Avx512& a = avx512();
  return a.os_zmm && a.f && a.bw && a.vl && a.vnni;
}

Isa active_isa() {
  return static_cast<Isa>(chosen_now() % kNamed);
}

bool one_row_avx512_for(const std::string& vendor, int family) {
  return vendor == "AuthenticAMD" && family >= 0x1A;
}

bool one_row_avx512() {
  static const bool pays = [] {
    const Identity id = identify();
    return one_row_avx512_for(id.vendor, id.family);
  }();
  return chosen_now() >= kNamed || pays;
}

bool isa_avx512() {
  return active_isa() == Isa::kAvx512Vnni;
}

std::string isa_name(Isa isa) {
  return isa == Isa::kAvx512Vnni ? "avx512-vnni" : "avx2";
}

std::string set_isa(const std::string& name) {
  const int v = choice(name, "the instruction set");
  chosen.store(v, std::memory_order_relaxed);
  return isa_name(static_cast<Isa>(v % kNamed));
}

}  // namespace loom_cpu
