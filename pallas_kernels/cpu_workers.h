// Helper threads for the CPU kernels (paged_attention/cpu_kernel.cc, matmul/cpu_matmul.cc): the caller
// and a few helpers share a kernel's work items. One process-wide set: the kernels are built into one
// library (cpu_library.py), so attention and projections find the same helpers awake.
//
// Why not XLA's intra-op pool: a decode step calls these kernels hundreds of times, tens of
// microseconds apart. Between two calls the pool's threads go to sleep, and waking one (a futex and,
// in a VM, an inter-processor interrupt) can take as long as the call itself: the caller then does
// all the work alone at one core's bandwidth (measured: the projection after attention ran at half
// the speed of the one before it). These helpers spin for a short while after each job, so calls
// that follow each other closely find them awake, and sleep on a condition variable when idle.
//
// A helper is optional for every job: the caller works from the first item and waits only for the
// items, never for a helper. Several callers at once (one program per device on a CPU mesh, or two
// engines in one process) each see their items done whoever takes them.

#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace jaxserve_cpu {

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#else
  std::this_thread::yield();
#endif
}

// Spins after which a wait also yields the core at each further spin (issue #29): with more runnable
// threads than cores (the engine's host thread beside the kernel's two, or other processes) the thread
// being waited for may be descheduled, and spinning on would hold the core it needs. Short waits (items
// microseconds apart, the usual case) never reach the yields. JAXSERVE_CPU_SPINS_BEFORE_YIELD sets it (0:
// never yield, the behaviour before; read once per process) for end-to-end A/B runs.
inline int64_t SpinsBeforeYield() {
  static const int64_t spins = [] {
    const char* value = std::getenv("JAXSERVE_CPU_SPINS_BEFORE_YIELD");
    return value != nullptr && *value != '\0' ? std::max<int64_t>(0, std::atoll(value)) : int64_t(1024);
  }();
  return spins;
}

inline void SpinOrYield(int64_t& spins) {
  CpuRelax();
  const int64_t limit = SpinsBeforeYield();
  if (++spins >= limit && limit > 0) std::this_thread::yield();
}

class HelperThreads {
 public:
  // The process's helpers, started at the first call with `count` threads (the intra-op pool's size
  // less the caller); later calls get the same ones.
  static HelperThreads& Get(int64_t count) {
    static HelperThreads* helpers = new HelperThreads(count);  // never destroyed: threads outlive exit
    return *helpers;
  }

  int64_t size() const { return int64_t(threads_.size()); }

  // Offers `job` to up to `wanted` idle helpers; returns at once.
  void Offer(std::shared_ptr<std::function<void()>> job, int64_t wanted) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      job_ = std::move(job);
      wanted_ = wanted;
      generation_.fetch_add(1, std::memory_order_release);
    }
    if (sleepers_.load() > 0) wake_.notify_all();
  }

 private:
  static constexpr auto kSpin = std::chrono::microseconds(300);

  explicit HelperThreads(int64_t count) {
    for (int64_t i = 0; i < count; ++i) threads_.emplace_back([this] { Loop(); });
    for (auto& thread : threads_) thread.detach();
  }

  void Loop() {
    uint64_t seen = generation_.load();
    while (true) {
      auto deadline = std::chrono::steady_clock::now() + kSpin;
      int64_t spins = 0;
      while (generation_.load(std::memory_order_acquire) == seen) {
        SpinOrYield(spins);
        if (spins % 64 == 0 && std::chrono::steady_clock::now() > deadline) break;
      }
      std::shared_ptr<std::function<void()>> job;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        if (generation_.load() == seen) {
          ++sleepers_;
          wake_.wait(lock, [&] { return generation_.load() != seen; });
          --sleepers_;
        }
        seen = generation_.load();
        if (wanted_ > 0) {
          --wanted_;
          job = job_;
        }
      }
      if (job) (*job)();
    }
  }

  std::vector<std::thread> threads_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> sleepers_{0};
  std::shared_ptr<std::function<void()>> job_;
  int64_t wanted_ = 0;
};

// Runs item(worker, index) for every index in [0, num_items) on the caller (worker 0) and the helpers
// that join (workers 1, 2, ... in the order they start; at most max_workers in all). Items are taken
// in contiguous runs that shrink as the work runs out (a guided schedule): each worker streams long
// runs of memory at first, and the last items balance the threads however late a helper joined.
// `schedule`, when given, starts each helper instead (XLA's intra-op pool, where several device programs
// share a CPU and spinning helpers would take cores from them).
inline void RunItems(int64_t max_workers, int64_t num_items, std::function<void(int64_t, int64_t)> item,
                     const std::function<void(std::function<void()>)>& schedule = nullptr) {
  if (num_items <= 0) return;
  struct Shared {
    std::function<void(int64_t, int64_t)> item;
    int64_t num_items = 0, max_workers = 1;
    std::atomic<int64_t> next{0}, done{0}, started{0};
  };
  auto shared = std::make_shared<Shared>();
  shared->item = std::move(item);
  shared->num_items = num_items;
  shared->max_workers = std::max<int64_t>(1, std::min(max_workers, num_items));
  auto work = [shared]() {
    const int64_t worker = shared->started++;
    if (worker >= shared->max_workers) return;
    while (true) {
      int64_t first = shared->next.load(), count = 0;
      do {
        count = std::max<int64_t>(1, (shared->num_items - first) / (2 * shared->max_workers));
      } while (first < shared->num_items && !shared->next.compare_exchange_weak(first, first + count));
      if (first >= shared->num_items) break;
      count = std::min(count, shared->num_items - first);
      for (int64_t i = first; i < first + count; ++i) shared->item(worker, i);
      shared->done += count;
    }
  };
  const int64_t wanted = shared->max_workers - 1;
  if (wanted > 0 && schedule) {
    for (int64_t h = 0; h < wanted; ++h) schedule(work);
  } else if (wanted > 0) {
    HelperThreads& helpers = HelperThreads::Get(max_workers - 1);
    if (helpers.size() > 0) helpers.Offer(std::make_shared<std::function<void()>>(work), wanted);
  }
  work();
  int64_t spins = 0;
  while (shared->done.load() < num_items) SpinOrYield(spins);
}

}  // namespace jaxserve_cpu
