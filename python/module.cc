// sparsekv._sparsekv: the C++ side of `import sparsekv` (pybind11). The Python package
// (python/sparsekv/__init__.py) wraps it with docstrings, exceptions and asyncio helpers.
//
// - Errors: a Status that is not OK raises the Python exception named after its code
//   (sparsekv.NotFound, sparsekv.IOError, ...), all subclasses of sparsekv.Error, with the
//   same message. Per-item statuses of a batch are returned as instances of the same classes.
// - Every call into the client library releases the GIL, so Python threads call at once (the
//   client is thread-safe) and the interpreter runs while a call waits for the daemon.
// - A GET's bytes are not copied into Python: each value is a read-only memoryview of a buffer
//   object that owns the client's vector, alive as long as the view.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "sparsekv/client.h"
#include "sparsekv/status.h"

namespace py = pybind11;

namespace sparsekv::python {
namespace {

// The exception class named after `code`, from the Python package.
py::object ErrorClass(StatusCode code) {
  py::module_ pkg = py::module_::import("sparsekv");
  const std::string name(StatusCodeName(code));
  if (py::hasattr(pkg, name.c_str())) return pkg.attr(name.c_str());
  return pkg.attr("Error");
}

// An exception instance for a per-item status (None for OK).
py::object ErrorObject(const Status& st) {
  if (st.ok()) return py::none();
  return ErrorClass(st.code())(std::string(st.message()));
}

// Raised from C++ to become the Python exception of its code.
struct StatusError {
  Status status;
};

[[noreturn]] void Raise(const Status& st) { throw StatusError{st}; }

template <typename T>
T Take(Result<T> r) {
  if (!r.ok()) Raise(r.status());
  return std::move(r).value();
}

// A 16-byte block key from any bytes-like object.
WireBlockHash KeyOf(const py::handle& key) {
  WireBlockHash h{};
  if (PyBytes_Check(key.ptr())) {  // the common case, without a buffer request
    if (PyBytes_GET_SIZE(key.ptr()) != 16) {
      throw py::value_error("a sparsekv key is 16 bytes (a 128-bit block hash); got " +
                            std::to_string(PyBytes_GET_SIZE(key.ptr())));
    }
    std::memcpy(h.data(), PyBytes_AS_STRING(key.ptr()), 16);
    return h;
  }
  py::buffer_info info = py::reinterpret_borrow<py::buffer>(key).request();
  if (info.size * info.itemsize != 16 || info.ndim > 1) {
    throw py::value_error("a sparsekv key is 16 bytes (a 128-bit block hash); got " +
                          std::to_string(info.size * info.itemsize));
  }
  std::memcpy(h.data(), info.ptr, 16);
  return h;
}

std::vector<WireBlockHash> KeysOf(const py::sequence& keys) {
  std::vector<WireBlockHash> out;
  out.reserve(py::len(keys));
  for (const py::handle& k : keys) out.push_back(KeyOf(k));
  return out;
}

// The bytes of one GET item, owned here; a memoryview of it is what Python sees.
struct Value {
  std::vector<std::byte> bytes;
};

const char* TierName(BlockTier t) {
  switch (t) {
    case BlockTier::kAbsent: return "absent";
    case BlockTier::kHost: return "host";
    case BlockTier::kSsd: return "ssd";
    case BlockTier::kRocksDb: return "rocksdb";
  }
  return "absent";
}

class PyClient {
 public:
  PyClient(const std::string& address, const std::string& ns, const std::string& token,
           const std::string& client_name, bool shared_memory, double timeout_seconds) {
    ClientOptions o;
    o.address = address;
    o.namespace_name = ns;
    o.token = token;
    o.client_name = client_name;
    o.shared_memory = shared_memory;
    o.timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_seconds * 1000));
    Result<std::unique_ptr<Client>> c = [&] {
      py::gil_scoped_release unlocked;
      return Client::Connect(o);
    }();
    client_ = std::shared_ptr<Client>(Take(std::move(c)));
  }

  std::vector<py::object> Put(const py::sequence& keys, const py::sequence& values) {
    if (py::len(keys) != py::len(values)) {
      throw py::value_error("put: " + std::to_string(py::len(keys)) + " keys and " + std::to_string(py::len(values)) +
                            " values");
    }
    std::vector<WireBlockHash> hashes = KeysOf(keys);
    std::vector<py::buffer_info> views;  // held, so the bytes stay put while the GIL is released
    views.reserve(hashes.size());
    std::vector<BundleRef> refs;
    refs.reserve(hashes.size());
    for (size_t i = 0; i < hashes.size(); ++i) {
      views.push_back(py::reinterpret_borrow<py::buffer>(values[i]).request());
      const py::buffer_info& v = views.back();
      if (v.ndim > 1 && v.strides.back() != v.itemsize) throw py::value_error("put: a value must be contiguous");
      refs.push_back({hashes[i], {static_cast<const std::byte*>(v.ptr), static_cast<size_t>(v.size * v.itemsize)}});
    }
    std::shared_ptr<Client> c = client();
    Result<std::vector<Status>> r = [&] {
      py::gil_scoped_release unlocked;
      return c->Put(refs);
    }();
    std::vector<py::object> out;
    for (const Status& st : Take(std::move(r))) out.push_back(ErrorObject(st));
    return out;
  }

  std::vector<py::object> Get(const py::sequence& keys) {
    std::vector<WireBlockHash> hashes = KeysOf(keys);
    std::shared_ptr<Client> c = client();
    Result<std::vector<GetResult>> r = [&] {
      py::gil_scoped_release unlocked;
      return c->Get(hashes);
    }();
    std::vector<GetResult> got = Take(std::move(r));
    std::vector<py::object> out;
    out.reserve(got.size());
    for (GetResult& g : got) {
      if (g.status.ok()) {
        out.push_back(py::memoryview(py::cast(Value{std::move(g.bytes)})));
      } else if (g.status.code() == StatusCode::kNotFound || g.status.code() == StatusCode::kCorruption) {
        out.push_back(py::none());  // a miss: absent, or dropped as damaged by the daemon
      } else {
        Raise(g.status);
      }
    }
    return out;
  }

  py::tuple Lookup(const py::sequence& keys) {
    std::vector<WireBlockHash> hashes = KeysOf(keys);
    std::shared_ptr<Client> c = client();
    Result<LookupResult> r = [&] {
      py::gil_scoped_release unlocked;
      return c->Lookup(hashes);
    }();
    LookupResult l = Take(std::move(r));
    py::list tiers;
    for (BlockTier t : l.tiers) tiers.append(TierName(t));
    return py::make_tuple(l.prefix_blocks, tiers);
  }

  std::vector<py::object> Delete(const py::sequence& keys) {
    std::vector<WireBlockHash> hashes = KeysOf(keys);
    std::shared_ptr<Client> c = client();
    Result<std::vector<Status>> r = [&] {
      py::gil_scoped_release unlocked;
      return c->Delete(hashes);
    }();
    std::vector<py::object> out;
    for (const Status& st : Take(std::move(r))) out.push_back(ErrorObject(st));
    return out;
  }

  std::string Stats() {
    std::shared_ptr<Client> c = client();
    std::string json;
    Status st;
    {
      py::gil_scoped_release unlocked;
      Result<std::string> r = c->Stats();
      if (r.ok()) {
        json = std::move(r).value();
      } else {
        st = r.status();
      }
    }
    if (!st.ok()) Raise(st);
    return json;
  }

  void Ping() {
    std::shared_ptr<Client> c = client();
    Status st;
    {
      py::gil_scoped_release unlocked;
      st = c->Ping();
    }
    if (!st.ok()) Raise(st);
  }

  // The connection goes once no call in flight holds it.
  void Close() {
    std::lock_guard<std::mutex> l(mu_);
    client_.reset();
  }

  bool shared_memory() { return client()->shared_memory(); }
  uint32_t max_payload_bytes() { return client()->max_payload_bytes(); }
  uint32_t block_tokens() { return client()->block_tokens(); }
  uint64_t session_id() { return client()->session_id(); }

 private:
  std::shared_ptr<Client> client() {
    std::lock_guard<std::mutex> l(mu_);
    if (!client_) Raise(Status::FailedPrecondition("the client is closed"));
    return client_;
  }

  std::mutex mu_;
  std::shared_ptr<Client> client_;
};

// The same batch GET as PyClient::Get, timed in C++ with no Python in the loop, on a
// connection of its own kept across calls as the Python client's is: the baseline for the
// Python client's overhead (bench/python/client_bench.py).
class CppBaseline {
 public:
  CppBaseline(const std::string& address, const std::string& ns, const std::string& token, bool shared_memory) {
    ClientOptions o;
    o.address = address;
    o.namespace_name = ns;
    o.token = token;
    o.shared_memory = shared_memory;
    o.client_name = "sparsekv-python-baseline";
    py::gil_scoped_release unlocked;
    client_ = Take(Client::Connect(o));
  }

  // Seconds per batch GET of `keys`, `iterations` times, each batch's results dropped before
  // the next (as the Python loop drops its list).
  std::vector<double> GetLoop(const py::sequence& keys, int iterations) {
    std::vector<WireBlockHash> hashes = KeysOf(keys);
    py::gil_scoped_release unlocked;
    std::vector<double> seconds;
    for (int i = 0; i < iterations; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      std::vector<GetResult> got = Take(client_->Get(hashes));
      seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      for (const GetResult& g : got) {
        if (!g.status.ok()) Raise(g.status);
      }
    }
    return seconds;
  }

 private:
  std::unique_ptr<Client> client_;
};

}  // namespace
}  // namespace sparsekv::python

PYBIND11_MODULE(_sparsekv, m) {
  using namespace sparsekv::python;
  m.doc() = "The C++ side of the sparsekv package; use `import sparsekv`.";
  m.attr("__version__") = SPARSEKV_VERSION;

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const StatusError& e) {
      py::object cls = ErrorClass(e.status.code());
      PyErr_SetObject(cls.ptr(), py::str(std::string(e.status.message())).ptr());
    }
  });

  py::class_<Value>(m, "_Value", py::buffer_protocol())
      .def_buffer([](Value& v) {
        return py::buffer_info(v.bytes.data(), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(v.bytes.size())}, {1}, /*readonly=*/true);
      });

  py::class_<PyClient>(m, "_Client")
      .def(py::init<const std::string&, const std::string&, const std::string&, const std::string&, bool, double>(),
           py::arg("address"), py::arg("namespace"), py::arg("token"), py::arg("client_name"),
           py::arg("shared_memory"), py::arg("timeout"))
      .def("put", &PyClient::Put)
      .def("get", &PyClient::Get)
      .def("lookup", &PyClient::Lookup)
      .def("delete", &PyClient::Delete)
      .def("stats", &PyClient::Stats)
      .def("ping", &PyClient::Ping)
      .def("close", &PyClient::Close)
      .def_property_readonly("shared_memory", &PyClient::shared_memory)
      .def_property_readonly("max_payload_bytes", &PyClient::max_payload_bytes)
      .def_property_readonly("block_tokens", &PyClient::block_tokens)
      .def_property_readonly("session_id", &PyClient::session_id);

  py::class_<CppBaseline>(m, "_CppBaseline")
      .def(py::init<const std::string&, const std::string&, const std::string&, bool>(), py::arg("address"),
           py::arg("namespace"), py::arg("token"), py::arg("shared_memory"))
      .def("get_loop", &CppBaseline::GetLoop, py::arg("keys"), py::arg("iterations"));
}
