#include "threadpool.h"

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace loom_cpu {
namespace {

// How long an idle worker spins (yielding its core to any other runnable
// thread as it goes) before it sleeps. Long enough to bridge the gap between
// two products of one decode step, short enough not to hold a core that
// other processes want.
constexpr auto kSpin = std::chrono::microseconds(200);

// When the caller, done with its share, then waits for the workers longer
// than its share took plus a millisecond (a worker was preempted: more
// runnable threads than cores; a time slice is milliseconds), the next
// regions run on the caller alone: 256 at first, doubling up to 8192 while
// workers keep being late, back to 256 once a region goes well. On a machine
// shared with busy processes this keeps one late worker from costing every
// product a time slice. The slack was 50 us: ordinary jitter on an idle
// machine (a worker finishing its last chunk a little after the caller)
// then sent whole stretches of a decode step to one core — 1024x2816 4-bit,
// one row, two threads: 191 us with that slack, 132 us without the switch.
constexpr int kSoloFirst = 256;
constexpr int kSoloMost = 8192;
constexpr auto kSlack = std::chrono::microseconds(1000);

int configured_threads() {
  if (const char* env = std::getenv("MLX_LOOM_CPU_THREADS")) {
    int n = std::atoi(env);
    if (n >= 1) {
      return std::min(n, 64);
    }
  }
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    return std::max(1, std::min(CPU_COUNT(&set), 64));
  }
  return std::max(1u, std::min(std::thread::hardware_concurrency(), 64u));
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// One region at a time is described by a single 64-bit ticket:
// generation (24 bits) | task count (20 bits) | next unclaimed task (20 bits).
// A thread claims task t by a compare-and-swap that only succeeds while the
// ticket still names the same region, so a worker waking late can never claim
// a task of the next region with the previous one's count, and the region's
// function stays valid while any claimed task runs (the caller returns only
// when every task has finished).
constexpr int kTaskBits = 20;
constexpr unsigned long long kTaskMask = (1ull << kTaskBits) - 1;

inline unsigned long long gen_of(unsigned long long t) {
  return t >> (2 * kTaskBits);
}

class Pool {
 public:
  explicit Pool(int threads) : threads_(threads) {
    for (int i = 1; i < threads_; ++i) {
      std::thread(&Pool::worker, this).detach();
    }
  }

  int threads() const {
    return threads_;
  }

  void run(int tasks, const std::function<void(int)>& fn) {
    if (tasks <= 0) {
      return;
    }
    if (threads_ == 1 || tasks == 1 || static_cast<unsigned long long>(tasks) > kTaskMask ||
        solo_.load(std::memory_order_relaxed) > 0) {
      if (threads_ > 1 && tasks > 1) {
        solo_.fetch_sub(1, std::memory_order_relaxed);
      }
      for (int t = 0; t < tasks; ++t) {
        fn(t);
      }
      return;
    }
    std::lock_guard<std::mutex> region(region_mutex_);
    fn_.store(&fn, std::memory_order_relaxed);
    error_ = nullptr;
    pending_.store(tasks, std::memory_order_relaxed);
    const unsigned long long gen = (gen_of(ticket_.load(std::memory_order_relaxed)) + 1) & 0xFFFFFF;
    {
      std::lock_guard<std::mutex> lock(wake_mutex_);
      ticket_.store(
          (gen << (2 * kTaskBits)) | (static_cast<unsigned long long>(tasks) << kTaskBits),
          std::memory_order_release);
    }
    if (sleepers_.load(std::memory_order_acquire) > 0) {
      wake_.notify_all();
    }
    const auto begin = std::chrono::steady_clock::now();
    work(gen);
    const auto done = std::chrono::steady_clock::now();
    int spins = 0;
    while (pending_.load(std::memory_order_acquire) > 0) {
      // Spin briefly, then yield the core: a preempted worker may need it.
      if (++spins < 256) {
        cpu_relax();
      } else {
        sched_yield();
      }
    }
    if (std::chrono::steady_clock::now() - done > (done - begin) + kSlack) {
      solo_.store(backoff_, std::memory_order_relaxed);
      backoff_ = std::min(backoff_ * 2, kSoloMost);
    } else {
      backoff_ = kSoloFirst;
    }
    if (error_) {
      std::exception_ptr e = error_;
      error_ = nullptr;
      std::rethrow_exception(e);
    }
  }

 private:
  // Claim and run tasks of region `gen` until none is left.
  void work(unsigned long long gen) {
    unsigned long long t = ticket_.load(std::memory_order_acquire);
    for (;;) {
      if (gen_of(t) != gen) {
        return;
      }
      const unsigned long long tasks = (t >> kTaskBits) & kTaskMask;
      const unsigned long long next = t & kTaskMask;
      if (next >= tasks) {
        return;
      }
      if (!ticket_.compare_exchange_weak(t, t + 1, std::memory_order_acq_rel)) {
        continue;  // t now holds the current ticket
      }
      const auto* fn = fn_.load(std::memory_order_relaxed);
      try {
        (*fn)(static_cast<int>(next));
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mutex_);
        if (!error_) {
          error_ = std::current_exception();
        }
      }
      pending_.fetch_sub(1, std::memory_order_acq_rel);
      t = ticket_.load(std::memory_order_acquire);
    }
  }

  void worker() {
    unsigned long long seen = gen_of(ticket_.load(std::memory_order_acquire));
    for (;;) {
      auto deadline = std::chrono::steady_clock::now() + kSpin;
      int spins = 0;
      while (gen_of(ticket_.load(std::memory_order_acquire)) == seen) {
        cpu_relax();
        if (++spins == 64) {
          spins = 0;
          // Let a runnable thread have this core while we wait: between two
          // products the thread that builds the next step's graph (the
          // interpreter) needs it, and a worker that only pauses keeps it
          // from that thread for half of every time slice. Measured, two
          // threads, per token: 350M 4-bit (int8 activations) ~26 -> ~21 ms,
          // 350M bf16 ~52 -> ~47 ms, a 4-layer model ~2.0 -> ~1.2 ms.
          sched_yield();
          if (std::chrono::steady_clock::now() > deadline) {
            std::unique_lock<std::mutex> lock(wake_mutex_);
            sleepers_.fetch_add(1, std::memory_order_acq_rel);
            wake_.wait(lock, [&] {
              return gen_of(ticket_.load(std::memory_order_acquire)) != seen;
            });
            sleepers_.fetch_sub(1, std::memory_order_acq_rel);
            deadline = std::chrono::steady_clock::now() + kSpin;
          }
        }
      }
      seen = gen_of(ticket_.load(std::memory_order_acquire));
      work(seen);
    }
  }

  const int threads_;
  std::mutex region_mutex_;
  std::mutex wake_mutex_;
  std::condition_variable wake_;
  std::mutex error_mutex_;
  std::exception_ptr error_;
  std::atomic<unsigned long long> ticket_{0};
  std::atomic<int> sleepers_{0};
  std::atomic<int> pending_{0};
  std::atomic<int> solo_{0};
  int backoff_ = kSoloFirst;  // guarded by region_mutex_
  std::atomic<const std::function<void(int)>*> fn_{nullptr};
};

Pool& pool() {
  // Never destroyed: its detached workers sleep until the process exits.
  static Pool* instance = new Pool(configured_threads());
  return *instance;
}

}  // namespace

int pool_threads() {
  return pool().threads();
}

void parallel_for(int tasks, const std::function<void(int)>& fn) {
  pool().run(tasks, fn);
}

}  // namespace loom_cpu
