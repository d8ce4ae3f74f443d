// Pinning the engine's compute threads to CPUs (threads.py says when and why).
//
//     bind_threads(cpus) -> int[]      intra-op thread i (the calling thread is 0) runs on cpus[i] only, for
//                                      i < min(len(cpus), torch's thread count); returns the CPU each bound thread
//                                      reported afterwards (sched_getcpu), for the log and the tests
//
// torch's intra-op threads are OpenMP's thread pool, which keeps its threads for the process's life: binding them
// once, from inside a parallel region, holds for every later kernel.

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <sched.h>

#include <cstdint>
#include <vector>

namespace {

std::vector<int64_t> bind_threads(at::IntArrayRef cpus) {
  const int64_t n = std::min<int64_t>(static_cast<int64_t>(cpus.size()), at::get_num_threads());
  TORCH_CHECK(n > 0, "bind_threads: no CPUs given");
  for (int64_t c : cpus) TORCH_CHECK(c >= 0 && c < CPU_SETSIZE, "bind_threads: CPU ", c, " out of range");
  std::vector<int64_t> got(n, -1);
  std::vector<int> err(n, 0);
  // grain 1 over n tasks: at::parallel_for runs task i on intra-op thread i when there are n threads
  at::parallel_for(0, n, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = at::get_thread_num();
      cpu_set_t set;
      CPU_ZERO(&set);
      CPU_SET(static_cast<int>(cpus[t]), &set);
      if (sched_setaffinity(0, sizeof set, &set) != 0) err[t] = 1;
      got[t] = sched_getcpu();
    }
  });
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(!err[i], "bind_threads: sched_setaffinity failed for CPU ", cpus[i]);
  return got;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(parrot_kernels, m) { m.def("bind_threads(int[] cpus) -> int[]", bind_threads); }
