// Pinning torch's OpenMP team to CPUs.
// Part of kernels.cpp's one translation unit, inside its anonymous namespace: no includes of its own.

// Pins the calling thread's OpenMP team, thread i to cpus[i]. libgomp keeps a team's threads for the next
// parallel regions of the same thread, so the pinning holds for every later kernel and Inductor loop.
void bind_threads(c10::IntArrayRef cpus) {
  const int n = int(cpus.size());
  TORCH_CHECK(n > 0, "bind_threads: no CPUs");
  std::vector<int> failed(n, -1);  // errno by thread; -1: the team had no thread i (OMP_THREAD_LIMIT)
#pragma omp parallel num_threads(n)
  {
    const int i = omp_get_thread_num();
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(int(cpus[i]), &set);
    failed[i] = sched_setaffinity(0, sizeof(set), &set) != 0 ? errno : 0;
  }
  for (int i = 0; i < n; ++i) {
    TORCH_CHECK(failed[i] >= 0, "cannot pin ", n, " threads: OpenMP gave fewer");
    TORCH_CHECK(failed[i] == 0, "cannot pin a thread to CPU ", cpus[i], ": ", std::strerror(failed[i]));
  }
}
