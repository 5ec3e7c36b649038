// Links against an installed libsparsekv and plans the V3.2 indexer cache.
#include <sparsekv/memory_planner.h>
#include <sparsekv/model_spec.h>
#include <sparsekv/page_pool.h>

#include <cstdio>

int main() {
  auto spec = sparsekv::ModelPreset("deepseek-v3.2-exp");
  if (!spec.ok()) return 1;
  auto plan = sparsekv::PlanForSequences(*spec, 128, 4, 65536);
  if (!plan.ok()) return 2;
  sparsekv::PagePoolOptions o;
  o.capacity = 4;
  o.page_bytes = 4096;
  auto pool = sparsekv::PagePool::Create(o);
  if (!pool.ok()) return 3;
  auto page = (*pool)->AllocatePinned();
  if (!page.ok()) return 4;
  std::printf("%llu\n", static_cast<unsigned long long>(plan->total_bytes));
  return 0;
}
