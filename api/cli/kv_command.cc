// `sparsekv put | get | lookup | stats | events`: the daemon from the command line.
#include <fmt/format.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>

#include "cli/client_options.h"
#include "cli/model_options.h"
#include "cli/registry.h"

namespace sparsekv::cli {
namespace {

struct KeyArgs {
  std::vector<std::string> keys;
  std::vector<std::string> hashes;
  void AddTo(CLI::App* app) {
    app->add_option("--key", keys, "Block key as text (its XXH3-128 is the block hash); repeatable");
    app->add_option("--hash", hashes, "Block hash as 32 hex digits; repeatable");
  }
  Result<std::vector<WireBlockHash>> Resolve() const {
    std::vector<WireBlockHash> out;
    for (const auto& k : keys) {
      SPARSEKV_ASSIGN_OR_RETURN(auto h, HashFromKey(k));
      out.push_back(h);
    }
    for (const auto& x : hashes) {
      SPARSEKV_ASSIGN_OR_RETURN(auto h, HashFromHex(x));
      out.push_back(h);
    }
    if (out.empty()) return Status::InvalidArgument("name at least one block with --key or --hash");
    return out;
  }
};

}  // namespace

SPARSEKV_CLI_COMMAND(put) {
  struct Args {
    ClientArgs client;
    KeyArgs key;
    std::string value, file;
  };
  auto a = std::make_shared<Args>();
  CLI::App* cmd = app.add_subcommand("put", "Store one block's bytes in sparsekvd");
  a->client.AddTo(cmd);
  a->key.AddTo(cmd);
  auto* v = cmd->add_option("--value", a->value, "The bytes, as text");
  auto* f = cmd->add_option("--file", a->file, "Read the bytes from a file")->check(CLI::ExistingFile);
  v->excludes(f);
  cmd->callback([a, &exit_code, v, f] {
    auto hashes = a->key.Resolve();
    if (!hashes.ok()) return void(exit_code = Fail(hashes.status()));
    if (hashes->size() != 1) return void(exit_code = Fail(Status::InvalidArgument("put takes exactly one --key or --hash")));
    if (v->count() == 0 && f->count() == 0) return void(exit_code = Fail(Status::InvalidArgument("put needs --value or --file")));
    std::string bytes = a->value;
    if (f->count()) {
      std::ifstream in(a->file, std::ios::binary);
      bytes.assign(std::istreambuf_iterator<char>(in), {});
    }
    auto client = a->client.Connect();
    if (!client.ok()) return void(exit_code = Fail(client.status()));
    BundleRef ref{(*hashes)[0], std::as_bytes(std::span<const char>(bytes.data(), bytes.size()))};
    auto r = (*client)->Put(std::span<const BundleRef>(&ref, 1));
    if (!r.ok()) return void(exit_code = Fail(r.status()));
    if (!(*r)[0].ok()) return void(exit_code = Fail((*r)[0]));
    std::printf("stored %zu bytes under %s\n", bytes.size(), HashToHex((*hashes)[0]).c_str());
  });
}

SPARSEKV_CLI_COMMAND(get) {
  struct Args {
    ClientArgs client;
    KeyArgs key;
    std::string out;
  };
  auto a = std::make_shared<Args>();
  CLI::App* cmd = app.add_subcommand("get", "Fetch one block's bytes from sparsekvd (to stdout or --out)");
  a->client.AddTo(cmd);
  a->key.AddTo(cmd);
  cmd->add_option("--out", a->out, "Write the bytes to this file");
  cmd->callback([a, &exit_code] {
    auto hashes = a->key.Resolve();
    if (!hashes.ok()) return void(exit_code = Fail(hashes.status()));
    if (hashes->size() != 1) return void(exit_code = Fail(Status::InvalidArgument("get takes exactly one --key or --hash")));
    auto client = a->client.Connect();
    if (!client.ok()) return void(exit_code = Fail(client.status()));
    auto r = (*client)->Get(*hashes);
    if (!r.ok()) return void(exit_code = Fail(r.status()));
    const GetResult& g = (*r)[0];
    if (!g.status.ok()) return void(exit_code = Fail(g.status));
    if (a->out.empty()) {
      std::fwrite(g.bytes.data(), 1, g.bytes.size(), stdout);
    } else {
      std::ofstream o(a->out, std::ios::binary);
      o.write(reinterpret_cast<const char*>(g.bytes.data()), static_cast<std::streamsize>(g.bytes.size()));
      if (!o) return void(exit_code = Fail(Status::IOError("cannot write " + a->out)));
    }
  });
}

SPARSEKV_CLI_COMMAND(lookup) {
  struct Args {
    ClientArgs client;
    KeyArgs key;
  };
  auto a = std::make_shared<Args>();
  CLI::App* cmd = app.add_subcommand("lookup", "Resumable prefix length of a list of blocks, and each block's tier");
  a->client.AddTo(cmd);
  a->key.AddTo(cmd);
  cmd->callback([a, &exit_code] {
    auto hashes = a->key.Resolve();
    if (!hashes.ok()) return void(exit_code = Fail(hashes.status()));
    auto client = a->client.Connect();
    if (!client.ok()) return void(exit_code = Fail(client.status()));
    auto r = (*client)->Lookup(*hashes);
    if (!r.ok()) return void(exit_code = Fail(r.status()));
    nlohmann::json j;
    j["prefix_blocks"] = r->prefix_blocks;
    nlohmann::json blocks = nlohmann::json::array();
    for (size_t i = 0; i < hashes->size(); ++i) {
      blocks.push_back({{"hash", HashToHex((*hashes)[i])}, {"tier", TierName(r->tiers[i])}});
    }
    j["blocks"] = std::move(blocks);
    std::printf("%s\n", j.dump(2).c_str());
  });
}

SPARSEKV_CLI_COMMAND(stats) {
  auto a = std::make_shared<ClientArgs>();
  CLI::App* cmd = app.add_subcommand("stats", "Statistics of a namespace in sparsekvd (JSON)");
  a->AddTo(cmd);
  cmd->callback([a, &exit_code] {
    auto client = a->Connect();
    if (!client.ok()) return void(exit_code = Fail(client.status()));
    auto s = (*client)->Stats();
    if (!s.ok()) return void(exit_code = Fail(s.status()));
    std::printf("%s\n", nlohmann::json::parse(*s, nullptr, false).dump(2).c_str());
  });
}

SPARSEKV_CLI_COMMAND(events) {
  struct Args {
    ClientArgs client;
    uint64_t count = 0;
    double seconds = 0;
  };
  auto a = std::make_shared<Args>();
  CLI::App* cmd = app.add_subcommand("events", "Print a namespace's KV events as JSON lines");
  a->client.AddTo(cmd);
  cmd->add_option("--count", a->count, "Stop after this many events (0: no limit)");
  cmd->add_option("--seconds", a->seconds, "Stop after this long (0: no limit)");
  cmd->callback([a, &exit_code] {
    auto client = a->client.Connect();
    if (!client.ok()) return void(exit_code = Fail(client.status()));
    std::mutex mu;
    std::condition_variable cv;
    uint64_t seen = 0;
    Status st = (*client)->Subscribe([&](const EventNotice& e) {
      static const char* kTypes[] = {"?", "stored", "removed", "all_cleared"};
      nlohmann::json j{{"sequence", e.sequence}, {"type", kTypes[e.type <= 3 ? e.type : 0]}, {"tier", TierName(e.tier)}};
      nlohmann::json hashes = nlohmann::json::array();
      for (const auto& h : e.hashes) hashes.push_back(HashToHex(h));
      j["hashes"] = std::move(hashes);
      std::printf("%s\n", j.dump().c_str());
      std::fflush(stdout);
      std::lock_guard<std::mutex> l(mu);
      ++seen;
      cv.notify_all();
    });
    if (!st.ok()) return void(exit_code = Fail(st));
    std::unique_lock<std::mutex> l(mu);
    auto done = [&] { return a->count && seen >= a->count; };
    if (a->seconds > 0) {
      cv.wait_for(l, std::chrono::duration<double>(a->seconds), done);
    } else {
      cv.wait(l, done);
    }
  });
}

}  // namespace sparsekv::cli
