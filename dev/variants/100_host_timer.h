#include <chrono>
#include <cstdio>
namespace fxfuse_timing {
struct HostTimer {
  double sums[16] = {};
  long calls = 0;
  std::chrono::steady_clock::time_point last;
  const char* name;
  explicit HostTimer(const char* n) : name(n) {}
  void start() { last = std::chrono::steady_clock::now(); }
  void stamp(int i) {
    auto now = std::chrono::steady_clock::now();
    sums[i] += std::chrono::duration<double, std::micro>(now - last).count();
    last = now;
  }
  void done() {
    if (++calls % 100 != 0) return;
    double total = 0;
    for (int i = 0; i < 16; ++i) total += sums[i];
    std::fprintf(stderr, "TIMER %s total %.1f:", name, total / 100);
    for (int i = 0; i < 16; ++i) if (sums[i] > 0) std::fprintf(stderr, " %d:%.1f", i, sums[i] / 100), sums[i] = 0;
    std::fprintf(stderr, "\n");
  }
};
}  // namespace fxfuse_timing
