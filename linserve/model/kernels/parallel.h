// Work shared out task by task: threads take the next task from one counter.
//
// at::parallel_for hands each thread a fixed share of the range. The two vCPUs of this kind
// of VM do not run at the same pace (one reads memory faster, one is woken later), so with
// fixed shares the faster thread waits at the end of every product; at batch 1 the worker
// thread of a Mamba2 step sat idle for about a fifth of it (perf, bench.mamba2_step's
// shape). Taking tasks from a counter ends the threads within one task of each other.
// Which thread runs a task never changes how it is computed, so results do not depend on it.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace linserve {

// The tasks [0, tasks) of one parallel region, handed out in order.
class TaskQueue {
 public:
  explicit TaskQueue(int64_t tasks) : tasks_(tasks) {}
  // The next task, or -1 when none is left.
  int64_t take() {
    const int64_t t = next_.fetch_add(1, std::memory_order_relaxed);
    return t < tasks_ ? t : -1;
  }

 private:
  std::atomic<int64_t> next_{0};
  const int64_t tasks_;
};

// worker(queue) on each thread (as many as there are tasks, at most the pool's size); each
// worker calls queue.take() until it returns -1. Inside a parallel region, or with one
// thread, the caller's thread is the only worker.
template <typename W>
inline void parallel_tasks(int64_t tasks, const W& worker) {
  TaskQueue queue(tasks);
  const int64_t workers = std::min<int64_t>(tasks, at::get_num_threads());
  if (workers <= 1 || at::in_parallel_region()) return worker(queue);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) { worker(queue); });
}

// f(t) for every task t in [0, tasks), threads taking tasks one at a time.
template <typename F>
inline void for_each_task(int64_t tasks, const F& f) {
  parallel_tasks(tasks, [&](TaskQueue& queue) {
    for (int64_t t = queue.take(); t >= 0; t = queue.take()) f(t);
  });
}

}  // namespace linserve
