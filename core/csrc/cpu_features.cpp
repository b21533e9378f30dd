#include "cpu_features.h"

namespace loom_cpu {

std::vector<std::pair<std::string, bool>> cpu_features() {
  __builtin_cpu_init();
  // __builtin_cpu_supports also checks that the OS saves the AVX state.
  return {
      {"avx2", static_cast<bool>(__builtin_cpu_supports("avx2"))},
      {"fma", static_cast<bool>(__builtin_cpu_supports("fma"))},
      {"f16c", static_cast<bool>(__builtin_cpu_supports("f16c"))},
      {"avx512f", static_cast<bool>(__builtin_cpu_supports("avx512f"))},
      {"avx512bw", static_cast<bool>(__builtin_cpu_supports("avx512bw"))},
  };
}

std::string missing_instructions() {
  std::string missing;
  for (const auto& [name, present] : cpu_features()) {
    if (name.rfind("avx512", 0) == 0) {
      continue;  // detected and reported; no kernel needs it
    }
    if (!present) {
      missing += (missing.empty() ? "" : ", ") + name;
    }
  }
  return missing;
}

}  // namespace loom_cpu
