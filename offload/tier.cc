#include "sparsekv/tier.h"

#include <memory>

namespace sparsekv {
namespace {

// A callback that fulfils a promise: the future forms of the tier calls.
template <typename T>
std::pair<std::function<void(T)>, std::future<T>> PromiseCallback() {
  auto promise = std::make_shared<std::promise<T>>();
  std::future<T> future = promise->get_future();
  return {[promise](T value) { promise->set_value(std::move(value)); }, std::move(future)};
}

}  // namespace

std::string_view DurabilityName(Durability d) {
  switch (d) {
    case Durability::kNone:
      return "none";
    case Durability::kFdatasync:
      return "fdatasync";
    case Durability::kDsync:
      return "dsync";
  }
  return "unknown";
}

Result<Durability> ParseDurability(std::string_view name) {
  if (name == "none") return Durability::kNone;
  if (name == "fdatasync") return Durability::kFdatasync;
  if (name == "dsync") return Durability::kDsync;
  return Status::InvalidArgument("unknown durability '" + std::string(name) +
                                 "', expected none, fdatasync or dsync");
}

std::future<std::vector<Status>> Tier::Put(std::vector<BundlePtr> bundles) {
  auto [cb, f] = PromiseCallback<std::vector<Status>>();
  PutAsync(std::move(bundles), std::move(cb));
  return std::move(f);
}

std::future<std::vector<Result<BundlePtr>>> Tier::Get(std::vector<BundleKey> keys) {
  auto [cb, f] = PromiseCallback<std::vector<Result<BundlePtr>>>();
  GetAsync(std::move(keys), std::move(cb));
  return std::move(f);
}

std::future<std::vector<bool>> Tier::Contains(std::vector<BundleKey> keys) {
  auto [cb, f] = PromiseCallback<std::vector<bool>>();
  ContainsAsync(std::move(keys), std::move(cb));
  return std::move(f);
}

std::future<std::vector<Status>> Tier::Erase(std::vector<BundleKey> keys) {
  auto [cb, f] = PromiseCallback<std::vector<Status>>();
  EraseAsync(std::move(keys), std::move(cb));
  return std::move(f);
}

std::future<std::vector<Status>> Tier::EraseOlder(std::vector<BundleKey> keys,
                                                  std::vector<uint64_t> below) {
  auto [cb, f] = PromiseCallback<std::vector<Status>>();
  EraseOlderAsync(std::move(keys), std::move(below), std::move(cb));
  return std::move(f);
}

}  // namespace sparsekv
