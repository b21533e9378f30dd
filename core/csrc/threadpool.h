// A small persistent pool so one product uses every core MLX's CPU stream
// leaves idle (MLX runs each CPU primitive on one thread).
#pragma once

#include <functional>

namespace loom_cpu {

// Threads that take part in a parallel region: the caller plus the workers.
// Fixed at first use from MLX_LOOM_CPU_THREADS, else the CPUs this process
// may run on.
int pool_threads();

// Run fn(t) for every t in [0, tasks), the caller taking part, and return
// when all have finished. Regions from different threads run one at a time.
// Workers spin briefly between regions (a decode step issues hundreds of
// products back to back) and then sleep.
void parallel_for(int tasks, const std::function<void(int)>& fn);

}  // namespace loom_cpu
