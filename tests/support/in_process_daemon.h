// An in-process sparsekvd for the daemon tests: the store, then the server in front of it.
#pragma once

#include <gtest/gtest.h>

#include <memory>

#include "server/server.h"
#include "server/tiered_store.h"

namespace sparsekv::testing {

// Opens the store and starts the server on it; a failure is a fatal test failure (callers wrap
// it in ASSERT_NO_FATAL_FAILURE).
inline void StartInProcess(const server::TieredStoreOptions& so, const server::ServerOptions& opts,
                           std::unique_ptr<server::TieredStore>& store, std::unique_ptr<server::Server>& server) {
  auto opened = server::TieredStore::Open(so);
  ASSERT_TRUE(opened.ok()) << opened.status().ToString();
  store = std::move(opened).value();
  auto started = server::Server::Start(opts, store.get());
  ASSERT_TRUE(started.ok()) << started.status().ToString();
  server = std::move(started).value();
}

}  // namespace sparsekv::testing
