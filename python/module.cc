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
#include <dlpack/dlpack.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <atomic>
#include <deque>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "allocator/stream_copy.h"
#include "sparsekv/block_hash.h"
#include "sparsekv/cache_manager.h"
#include "sparsekv/client.h"
#include "sparsekv/codec.h"
#include "sparsekv/kv_events.h"
#include "sparsekv/lightning_indexer.h"
#include "sparsekv/memory_planner.h"
#include "sparsekv/paged_cache_view.h"
#include "sparsekv/sparse_mla.h"
#include "sparsekv/storage_format.h"
#include "sparsekv/model_spec.h"
#include "sparsekv/offload_options.h"
#include "sparsekv/offloaded_cache.h"
#include "sparsekv/request_log.h"
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

// Keys given as one C-contiguous buffer of n * 16 bytes (a numpy uint8 [n, 16] array, bytes of
// n keys back to back), or as a sequence of 16-byte keys.
std::vector<WireBlockHash> KeysOfAny(const py::object& keys) {
  if (!py::isinstance<py::sequence>(keys) || py::isinstance<py::bytes>(keys) || py::isinstance<py::array>(keys)) {
    py::buffer_info info = py::reinterpret_borrow<py::buffer>(keys).request();
    const size_t bytes = static_cast<size_t>(info.size * info.itemsize);
    const bool contiguous = info.ndim <= 1 ? (info.ndim == 0 || info.strides[0] == info.itemsize)
                                           : info.strides.back() == info.itemsize &&
                                                 info.strides[0] == info.shape.back() * info.itemsize;
    if (bytes % 16 != 0 || !contiguous || info.ndim > 2) {
      throw py::value_error("keys: a C-contiguous buffer of 16-byte keys back to back; got " + std::to_string(bytes) +
                            " bytes in " + std::to_string(info.ndim) + " dimensions");
    }
    std::vector<WireBlockHash> out(bytes / 16);
    if (bytes > 0) std::memcpy(out.data(), info.ptr, bytes);
    return out;
  }
  std::vector<WireBlockHash> out;
  for (const py::handle& k : keys) out.push_back(KeyOf(k));
  return out;
}

std::vector<WireBlockHash> KeysOf(const py::sequence& keys) {
  std::vector<WireBlockHash> out;
  out.reserve(py::len(keys));
  for (const py::handle& k : keys) out.push_back(KeyOf(k));
  return out;
}

// The bytes of one GET item, owned here; a memoryview of it is what Python sees. A bare CPython
// type with the buffer protocol (read-only): making one and its memoryview costs two small
// objects, where a pybind11 instance and its buffer_info cost about 1.5 us more per value
// (a 64-value batch over shared memory took 1.2x the C++ client's time that way).
struct ValueObject {
  PyObject_HEAD
  std::shared_ptr<const void>* owner;  // owned: keeps `data` alive (a buffer, or a lease of views)
  const std::byte* data;
  Py_ssize_t size;
};

// The CPython idiom for a static type: its head set, every other slot zero (filled in below).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmissing-field-initializers"
PyTypeObject ValueType = {PyVarObject_HEAD_INIT(nullptr, 0)};
#pragma GCC diagnostic pop

void ValueDealloc(PyObject* self) {
  delete reinterpret_cast<ValueObject*>(self)->owner;
  Py_TYPE(self)->tp_free(self);
}

int ValueGetBuffer(PyObject* self, Py_buffer* view, int flags) {
  const ValueObject* v = reinterpret_cast<ValueObject*>(self);
  return PyBuffer_FillInfo(view, self, const_cast<std::byte*>(v->data), v->size, /*readonly=*/1, flags);
}

PyBufferProcs kValueBuffer{ValueGetBuffer, nullptr};

void RegisterValueType(py::module_& m) {
  ValueType.tp_name = "sparsekv._sparsekv._Value";
  ValueType.tp_basicsize = sizeof(ValueObject);
  ValueType.tp_flags = Py_TPFLAGS_DEFAULT;
  ValueType.tp_doc = "The bytes of one GET value (read through a memoryview).";
  ValueType.tp_dealloc = ValueDealloc;
  ValueType.tp_as_buffer = &kValueBuffer;
  if (PyType_Ready(&ValueType) < 0) throw py::error_already_set();
  Py_INCREF(&ValueType);
  m.add_object("_Value", py::handle(reinterpret_cast<PyObject*>(&ValueType)));
}

// A read-only memoryview of `bytes`, which `owner` keeps alive.
py::object OwnedView(std::shared_ptr<const void> owner, std::span<const std::byte> bytes) {
  ValueObject* v = PyObject_New(ValueObject, &ValueType);
  if (v == nullptr) throw py::error_already_set();
  v->owner = new std::shared_ptr<const void>(std::move(owner));
  v->data = bytes.data();
  v->size = static_cast<Py_ssize_t>(bytes.size());
  PyObject* view = PyMemoryView_FromObject(reinterpret_cast<PyObject*>(v));
  Py_DECREF(v);  // the view holds it now
  if (view == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(view);
}

// A read-only memoryview owning `bytes`.
py::object ValueView(std::vector<std::byte>&& bytes) {
  auto owned = std::make_shared<const std::vector<std::byte>>(std::move(bytes));
  const std::span<const std::byte> b(*owned);
  return OwnedView(std::move(owned), b);
}

// Writable memory a GET may land in, from Python: a CPU torch tensor (contiguous), any object
// exporting a writable C-contiguous buffer (bytearray, numpy array, memoryview), or a
// (pointer, length) pair of ints. Held (the buffer exported, the object referenced) until the
// Destinations are gone, so the memory stays put while the GIL is released.
class Destinations {
 public:
  Destinations() = default;
  Destinations(const Destinations&) = delete;
  Destinations& operator=(const Destinations&) = delete;
  ~Destinations() {
    for (Py_buffer& b : buffers_) PyBuffer_Release(&b);
  }

  // The memory of `obj` (see above), appended whole.
  std::span<std::byte> Add(const py::handle& obj) {
    std::span<std::byte> span = Memory(obj);
    spans_.push_back(span);
    return span;
  }

  // `out` for `n` keys: a list or tuple of one destination per key, or one destination cut into
  // n equal slices (a tensor or array of n pages).
  void For(const py::object& out, size_t n) {
    const bool pair = py::isinstance<py::tuple>(out) && py::len(out) == 2 &&
                      py::isinstance<py::int_>(out[py::int_(0)]) && py::isinstance<py::int_>(out[py::int_(1)]);
    if ((py::isinstance<py::list>(out) || py::isinstance<py::tuple>(out)) && !pair) {
      if (py::len(out) != n) {
        throw py::value_error("get_into: " + std::to_string(n) + " keys and " + std::to_string(py::len(out)) +
                              " destinations");
      }
      for (const py::handle& d : out) Add(d);
      return;
    }
    const std::span<std::byte> whole = Memory(out);
    if (n == 0) return;
    if (whole.size() % n != 0) {
      throw py::value_error("get_into: a destination of " + std::to_string(whole.size()) +
                            " bytes does not split into " + std::to_string(n) + " equal slices");
    }
    const size_t each = whole.size() / n;
    for (size_t i = 0; i < n; ++i) spans_.push_back(whole.subspan(i * each, each));
  }

  std::span<const std::span<std::byte>> spans() const { return spans_; }

 private:
  std::span<std::byte> Memory(const py::handle& obj) {
    if (py::isinstance<py::tuple>(obj) && py::len(obj) == 2) {  // (pointer, length)
      const uintptr_t ptr = obj[py::int_(0)].cast<uintptr_t>();
      const size_t len = obj[py::int_(1)].cast<size_t>();
      if (ptr == 0 && len != 0) throw py::value_error("get_into: a null pointer");
      return {reinterpret_cast<std::byte*>(ptr), len};
    }
    if (py::hasattr(obj, "data_ptr") && py::hasattr(obj, "element_size") && py::hasattr(obj, "is_contiguous")) {
      if (obj.attr("device").attr("type").cast<std::string>() != "cpu") {
        throw py::value_error("get_into: a tensor must be in CPU memory (copy it to the device afterwards)");
      }
      if (!obj.attr("is_contiguous")().cast<bool>()) throw py::value_error("get_into: a tensor must be contiguous");
      held_.push_back(py::reinterpret_borrow<py::object>(obj));
      const uintptr_t ptr = obj.attr("data_ptr")().cast<uintptr_t>();
      const size_t len = obj.attr("element_size")().cast<size_t>() * obj.attr("numel")().cast<size_t>();
      return {reinterpret_cast<std::byte*>(ptr), len};
    }
    Py_buffer b;
    if (PyObject_GetBuffer(obj.ptr(), &b, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) != 0) {
      PyErr_Clear();
      throw py::type_error(
          "get_into: a destination is a writable C-contiguous buffer (bytearray, numpy array, memoryview), a CPU "
          "torch tensor, or a (pointer, length) pair");
    }
    buffers_.push_back(b);
    return {static_cast<std::byte*>(b.buf), static_cast<size_t>(b.len)};
  }

  std::vector<std::span<std::byte>> spans_;
  std::deque<Py_buffer> buffers_;
  std::vector<py::object> held_;
};

// GetInto's answers for Python: per key the value's size, or None for a miss (absent, or
// dropped by the daemon as damaged); any other item error raises, a value too large for its
// destination included (OutOfRange).
py::list IntoAnswers(const std::vector<GetIntoResult>& got) {
  py::list out;
  for (const GetIntoResult& g : got) {
    if (g.status.ok()) {
      out.append(py::int_(g.bytes));
    } else if (g.status.code() == StatusCode::kNotFound || g.status.code() == StatusCode::kCorruption) {
      out.append(py::none());
    } else {
      Raise(g.status);
    }
  }
  return out;
}

const char* TierName(BlockTier t) {
  switch (t) {
    case BlockTier::kAbsent: return "absent";
    case BlockTier::kHost: return "host";
    case BlockTier::kSsd: return "ssd";
    case BlockTier::kRocksDb: return "rocksdb";
    case BlockTier::kRemote: return "remote";
  }
  return "absent";
}

ClientOptions OptionsOf(const std::string& address, const std::string& ns, const std::string& token,
                        const std::string& client_name, bool shared_memory, double timeout_seconds) {
  ClientOptions o;
  o.address = address;
  o.namespace_name = ns;
  o.token = token;
  o.client_name = client_name;
  o.shared_memory = shared_memory;
  o.timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_seconds * 1000));
  return o;
}

class PyClient {
 public:
  PyClient(const std::string& address, const std::string& ns, const std::string& token,
           const std::string& client_name, bool shared_memory, double timeout_seconds) {
    const ClientOptions o = OptionsOf(address, ns, token, client_name, shared_memory, timeout_seconds);
    Result<std::unique_ptr<Client>> c = [&] {
      py::gil_scoped_release unlocked;
      return Client::Connect(o);
    }();
    client_ = std::shared_ptr<Client>(Take(std::move(c)));
  }

  // Runs `call` on the client with the GIL released (other Python threads go on meanwhile);
  // its value, or its error raised.
  template <typename F>
  auto Unlocked(F&& call) -> decltype(Take(call(std::declval<Client&>()))) {
    std::shared_ptr<Client> c = client();
    auto r = [&] {
      py::gil_scoped_release unlocked;
      return call(*c);
    }();
    return Take(std::move(r));
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
    std::vector<py::object> out;
    for (const Status& st : Unlocked([&](Client& c) { return c.Put(refs); })) out.push_back(ErrorObject(st));
    return out;
  }

  std::vector<py::object> Get(const py::sequence& keys) {
    std::vector<WireBlockHash> hashes = KeysOf(keys);
    std::vector<GetResult> got = Unlocked([&](Client& c) { return c.Get(hashes); });
    std::vector<py::object> out;
    out.reserve(got.size());
    for (GetResult& g : got) {
      if (g.status.ok()) {
        out.push_back(ValueView(std::move(g.bytes)));
      } else if (g.status.code() == StatusCode::kNotFound || g.status.code() == StatusCode::kCorruption) {
        out.push_back(py::none());  // a miss: absent, or dropped as damaged by the daemon
      } else {
        Raise(g.status);
      }
    }
    return out;
  }

  py::list GetInto(const py::sequence& keys, const py::object& out) {
    std::vector<WireBlockHash> hashes = KeysOf(keys);
    Destinations dests;
    dests.For(out, hashes.size());
    return IntoAnswers(Unlocked([&](Client& c) { return c.GetInto(hashes, dests.spans()); }));
  }

  // Zero-copy reads: per key a read-only memoryview of the value lent in place (or copied where
  // it could not be), or None for a miss. The lease ends once every memoryview of the call (and
  // every object made from one) is gone.
  py::list GetViews(const py::sequence& keys) {
    std::vector<WireBlockHash> hashes = KeysOf(keys);
    auto views = std::make_shared<ValueViews>(Unlocked([&](Client& c) { return c.GetViews(hashes); }));
    py::list out;
    for (size_t i = 0; i < views->size(); ++i) {
      const Status& st = views->status(i);
      if (st.ok()) {
        out.append(OwnedView(views, views->bytes(i)));
      } else if (st.code() == StatusCode::kNotFound || st.code() == StatusCode::kCorruption) {
        out.append(py::none());
      } else {
        Raise(st);
      }
    }
    return out;
  }

  // Values in pieces, for plug-ins that keep one value's bytes in several places (vLLM's
  // per-layer KV cache tensors): key i's value is the concatenation of pieces
  // [first_i, first_i + counts[i]) of (ptrs, sizes), first_i the sum of the counts before it.
  // The addresses must lie in memory the caller holds for the call (as get_into's (pointer,
  // length) pairs). Checked: the arrays' lengths agree.
  struct Pieces {
    std::vector<WireBlockHash> hashes;
    py::array_t<uint64_t, py::array::c_style | py::array::forcecast> ptrs, sizes;
    py::array_t<uint64_t, py::array::c_style | py::array::forcecast> counts;
    std::vector<size_t> first;   // per key, its first piece
    std::vector<uint64_t> total;  // per key, its bytes
  };
  static Pieces PiecesOf(const py::object& keys, const py::object& ptrs, const py::object& sizes,
                         const py::object& counts) {
    Pieces p;
    p.hashes = KeysOfAny(keys);
    p.ptrs = py::array_t<uint64_t, py::array::c_style | py::array::forcecast>::ensure(ptrs);
    p.sizes = py::array_t<uint64_t, py::array::c_style | py::array::forcecast>::ensure(sizes);
    p.counts = py::array_t<uint64_t, py::array::c_style | py::array::forcecast>::ensure(counts);
    if (!p.ptrs || !p.sizes || !p.counts) throw py::value_error("pieces: ptrs, sizes and counts are integer arrays");
    if (p.ptrs.ndim() != 1 || p.sizes.ndim() != 1 || p.counts.ndim() != 1 ||
        static_cast<size_t>(p.counts.size()) != p.hashes.size() || p.ptrs.size() != p.sizes.size()) {
      throw py::value_error("pieces: " + std::to_string(p.hashes.size()) + " keys, " +
                            std::to_string(p.counts.size()) + " counts, " + std::to_string(p.ptrs.size()) +
                            " pointers and " + std::to_string(p.sizes.size()) + " sizes");
    }
    const uint64_t* c = p.counts.data();
    const uint64_t* z = p.sizes.data();
    size_t at = 0;
    p.first.resize(p.hashes.size());
    p.total.resize(p.hashes.size());
    for (size_t i = 0; i < p.hashes.size(); ++i) {
      if (c[i] > static_cast<uint64_t>(p.ptrs.size()) - at) {
        throw py::value_error("pieces: the counts name more pieces than the " + std::to_string(p.ptrs.size()) +
                              " given");
      }
      p.first[i] = at;
      for (uint64_t k = 0; k < c[i]; ++k) p.total[i] += z[at + k];
      at += c[i];
    }
    if (at != static_cast<size_t>(p.ptrs.size())) {
      throw py::value_error("pieces: the counts name " + std::to_string(at) + " pieces of the " +
                            std::to_string(p.ptrs.size()) + " given");
    }
    return p;
  }

  // Consecutive runs of keys of at most kPiecesChunk bytes (one key at least): the unit of a
  // get_into_pieces or put_pieces call to the daemon.
  static constexpr uint64_t kPiecesChunk = 16ull << 20;
  static std::vector<std::pair<size_t, size_t>> ChunksOf(const Pieces& p) {
    std::vector<std::pair<size_t, size_t>> out;
    for (size_t begin = 0; begin < p.hashes.size();) {
      size_t end = begin;
      uint64_t bytes = 0;
      while (end < p.hashes.size() && (end == begin || bytes + p.total[end] <= kPiecesChunk)) bytes += p.total[end++];
      out.emplace_back(begin, end);
      begin = end;
    }
    return out;
  }

  // Per key the value's size, its bytes spread over its pieces when the size is their total
  // (else nothing is written: the caller sees the size differ), or None for a miss (absent, or
  // dropped as damaged). Values are read in place where the daemon lends them (get_views), each
  // then copied once into its pieces, in calls of at most 16 MiB so the lent pages stay within
  // the daemon's pin budget; the next call is made while this one's values are copied, so the
  // daemon's reading and checking of one overlaps the copy of the other. A call of
  // kStreamReadBytes or more writes its pieces with streaming stores (CopyBytes).
  py::list GetIntoPieces(const py::object& keys, const py::object& ptrs, const py::object& sizes,
                         const py::object& counts) {
    Pieces p = PiecesOf(keys, ptrs, sizes, counts);
    const size_t n = p.hashes.size();
    uint64_t all = 0;
    for (uint64_t t : p.total) all += t;
    const bool stream = all >= kStreamReadBytes;
    std::vector<int64_t> got(n, -1);
    std::shared_ptr<Client> c = client();
    Status failed;
    {
      py::gil_scoped_release unlocked;
      const uint64_t* ptr = p.ptrs.data();
      const uint64_t* size = p.sizes.data();
      const uint64_t* count = p.counts.data();
      const std::vector<std::pair<size_t, size_t>> chunks = ChunksOf(p);
      auto fetch = [&c, &p](std::pair<size_t, size_t> r) {
        return c->GetViews(std::span(p.hashes).subspan(r.first, r.second - r.first));
      };
      std::future<Result<ValueViews>> next;
      if (!chunks.empty()) next = std::async(std::launch::async, fetch, chunks[0]);
      for (size_t k = 0; k < chunks.size() && next.valid(); ++k) {
        Result<ValueViews> views = next.get();
        if (views.ok() && failed.ok() && k + 1 < chunks.size()) {
          next = std::async(std::launch::async, fetch, chunks[k + 1]);
        }
        if (!views.ok()) {
          if (failed.ok()) failed = views.status();
          continue;
        }
        if (!failed.ok()) continue;
        const auto [begin, end] = chunks[k];
        for (size_t i = begin; i < end; ++i) {
          const Status& st = views->status(i - begin);
          if (!st.ok()) {
            if (st.code() != StatusCode::kNotFound && st.code() != StatusCode::kCorruption) failed = st;
            continue;
          }
          const std::span<const std::byte> v = views->bytes(i - begin);
          got[i] = static_cast<int64_t>(v.size());
          if (v.size() != p.total[i]) continue;
          uint64_t off = 0;
          for (size_t j = p.first[i]; j < p.first[i] + count[i]; ++j) {
            CopyBytes(reinterpret_cast<void*>(static_cast<uintptr_t>(ptr[j])), v.data() + off, size[j], stream);
            off += size[j];
          }
        }
        views->Release();
      }
    }
    if (!failed.ok()) Raise(failed);
    py::list out;
    for (int64_t g : got) out.append(g < 0 ? py::none() : py::object(py::int_(g)));
    return out;
  }

  // Stores key i's value, the concatenation of its pieces (Client::PutPieces): each value is
  // gathered straight into the staging area, or its write lease where the daemon grants them,
  // while the daemon stores the part before. Per key None or the item's error (not raised).
  std::vector<py::object> PutPieces(const py::object& keys, const py::object& ptrs, const py::object& sizes,
                                    const py::object& counts) {
    Pieces p = PiecesOf(keys, ptrs, sizes, counts);
    const size_t n = p.hashes.size();
    const uint64_t* ptr = p.ptrs.data();
    const uint64_t* size = p.sizes.data();
    const uint64_t* count = p.counts.data();
    std::vector<std::span<const std::byte>> spans(static_cast<size_t>(p.ptrs.size()));
    for (size_t j = 0; j < spans.size(); ++j) {
      spans[j] = {reinterpret_cast<const std::byte*>(static_cast<uintptr_t>(ptr[j])), static_cast<size_t>(size[j])};
    }
    std::vector<PiecesRef> values(n);
    for (size_t i = 0; i < n; ++i) {
      values[i] = {p.hashes[i],
                   std::span<const std::span<const std::byte>>(spans.data() + p.first[i], static_cast<size_t>(count[i]))};
    }
    const std::vector<Status> results = Unlocked([&](Client& c) { return c.PutPieces(values); });
    std::vector<py::object> out;
    for (const Status& st : results) out.push_back(ErrorObject(st));
    return out;
  }

  // lookup() with keys as one buffer and the tiers as one byte each (BlockTier: 0 absent,
  // 1 host, 2 ssd, 3 rocksdb, 4 remote): no Python object per key either way.
  py::tuple LookupArray(const py::object& keys) {
    std::vector<WireBlockHash> hashes = KeysOfAny(keys);
    const LookupResult l = Unlocked([&](Client& c) { return c.Lookup(hashes); });
    std::string tiers(l.tiers.size(), '\0');
    for (size_t i = 0; i < l.tiers.size(); ++i) tiers[i] = static_cast<char>(l.tiers[i]);
    return py::make_tuple(l.prefix_blocks, py::bytes(tiers));
  }

  py::tuple Lookup(const py::sequence& keys) {
    std::vector<WireBlockHash> hashes = KeysOf(keys);
    const LookupResult l = Unlocked([&](Client& c) { return c.Lookup(hashes); });
    py::list tiers;
    for (BlockTier t : l.tiers) tiers.append(TierName(t));
    return py::make_tuple(l.prefix_blocks, tiers);
  }

  std::vector<py::object> Delete(const py::sequence& keys) {
    std::vector<WireBlockHash> hashes = KeysOf(keys);
    std::vector<py::object> out;
    for (const Status& st : Unlocked([&](Client& c) { return c.Delete(hashes); })) out.push_back(ErrorObject(st));
    return out;
  }

  // (hint id, found, in_memory, prefetching)
  py::tuple Hint(const py::sequence& keys, double ttl_seconds) {
    if (!(ttl_seconds >= 0.001 && ttl_seconds <= 4294967.0)) {
      throw py::value_error("hint: ttl must be from 0.001 to 4294967 seconds; got " + std::to_string(ttl_seconds));
    }
    std::vector<WireBlockHash> hashes = KeysOf(keys);
    const auto ttl = std::chrono::milliseconds(static_cast<int64_t>(ttl_seconds * 1000.0 + 0.5));
    const Client::HintResult r = Unlocked([&](Client& c) { return c.Hint(hashes, ttl); });
    return py::make_tuple(r.hint, r.found, r.in_memory, r.prefetching);
  }

  void DropHint(uint64_t hint) {
    std::shared_ptr<Client> c = client();
    Status st;
    {
      py::gil_scoped_release unlocked;
      st = c->DropHint(hint);
    }
    if (!st.ok()) Raise(st);
  }

  void LogAppend(uint64_t request, uint64_t first_token, const std::vector<int32_t>& tokens) {
    std::shared_ptr<Client> c = client();
    Status st;
    {
      py::gil_scoped_release unlocked;  // waits for the daemon's fdatasync
      st = c->LogAppend(request, first_token, tokens);
    }
    if (!st.ok()) Raise(st);
  }
  void LogSuspended(uint64_t request, uint64_t state_tokens, const std::string& tail, uint64_t tag) {
    if (tail.size() != 16) Raise(Status::InvalidArgument("a tail key is 16 bytes"));
    WireBlockHash h;
    std::memcpy(h.data(), tail.data(), 16);
    std::shared_ptr<Client> c = client();
    Status st;
    {
      py::gil_scoped_release unlocked;
      st = c->LogSuspended(request, state_tokens, h, tag);
    }
    if (!st.ok()) Raise(st);
  }
  void LogFinish(uint64_t request) {
    std::shared_ptr<Client> c = client();
    Status st;
    {
      py::gil_scoped_release unlocked;
      st = c->LogFinish(request);
    }
    if (!st.ok()) Raise(st);
  }
  py::list LogRecover() {
    std::shared_ptr<Client> c = client();
    Result<std::vector<Client::LoggedRequest>> r = Status::Internal("");
    {
      py::gil_scoped_release unlocked;
      r = c->LogRecover();
    }
    if (!r.ok()) Raise(r.status());
    py::list out;
    for (const Client::LoggedRequest& q : *r) {
      py::object su = py::none();
      if (q.suspended) {
        su = py::make_tuple(q.state_tokens, py::bytes(reinterpret_cast<const char*>(q.tail.data()), 16), q.tag);
      }
      out.append(py::make_tuple(q.id, q.tokens, su));
    }
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
    const ClientOptions o = OptionsOf(address, ns, token, "sparsekv-python-baseline", shared_memory, 30.0);
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

  // The same with GetInto into `out` (as PyClient::GetInto takes it).
  std::vector<double> GetIntoLoop(const py::sequence& keys, const py::object& out, int iterations) {
    std::vector<WireBlockHash> hashes = KeysOf(keys);
    Destinations dests;
    dests.For(out, hashes.size());
    py::gil_scoped_release unlocked;
    std::vector<double> seconds;
    for (int i = 0; i < iterations; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      std::vector<GetIntoResult> got = Take(client_->GetInto(hashes, dests.spans()));
      seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      for (const GetIntoResult& g : got) {
        if (!g.status.ok()) Raise(g.status);
      }
    }
    return seconds;
  }

 private:
  std::unique_ptr<Client> client_;
};


// ---- cache side ----

// A block hash as the 16 bytes the daemon files it under (lo, then hi, little-endian).
py::bytes HashBytes(const BlockHash& h) {
  char b[16];
  std::memcpy(b, &h.lo, 8);
  std::memcpy(b + 8, &h.hi, 8);
  return py::bytes(b, 16);
}

// An element type of a pool view: its DLPack type and size.
struct ElementType {
  const char* name;
  DLDataType dl;
};
constexpr ElementType kElementTypes[] = {
    {"uint8", {kDLUInt, 8, 1}},    {"int8", {kDLInt, 8, 1}},         {"uint16", {kDLUInt, 16, 1}},
    {"int16", {kDLInt, 16, 1}},    {"bfloat16", {kDLBfloat, 16, 1}}, {"float32", {kDLFloat, 32, 1}},
    {"int32", {kDLInt, 32, 1}},    {"uint32", {kDLUInt, 32, 1}},
};

const ElementType& ElementTypeOf(const std::string& name) {
  for (const ElementType& t : kElementTypes) {
    if (name == t.name) return t;
  }
  Raise(Status::InvalidArgument("no pool view element type " + name));
}

// A strided view of a pool's memory, lent to other frameworks through DLPack
// (`__dlpack__`): torch.from_dlpack and numpy.from_dlpack take it without a copy. The view
// and every tensor made from it keep the manager (and so the pool) alive.
class PoolRegion {
 public:
  PoolRegion(std::shared_ptr<CacheManager> keep, std::byte* base, uint64_t arena_bytes, uint64_t offset,
             const std::string& dtype, std::vector<int64_t> shape, const std::vector<int64_t>& byte_strides)
      : keep_(std::move(keep)), type_(ElementTypeOf(dtype)), shape_(std::move(shape)) {
    const int64_t item = type_.dl.bits / 8;
    if (shape_.size() != byte_strides.size() || shape_.empty()) {
      Raise(Status::InvalidArgument("a pool view needs one stride per axis"));
    }
    // Every byte the view can reach lies in the arena: [offset, offset + span).
    uint64_t span = static_cast<uint64_t>(item);
    bool empty = false;
    for (size_t i = 0; i < shape_.size(); ++i) {
      if (shape_[i] < 0 || byte_strides[i] < 0 || byte_strides[i] % item != 0) {
        Raise(Status::InvalidArgument("a pool view's shape and strides are non-negative, strides a multiple of " +
                                      std::to_string(item) + " bytes"));
      }
      empty = empty || shape_[i] == 0;
      uint64_t reach = 0;
      if (shape_[i] > 0 && (__builtin_mul_overflow(static_cast<uint64_t>(shape_[i] - 1),
                                                   static_cast<uint64_t>(byte_strides[i]), &reach) ||
                            __builtin_add_overflow(span, reach, &span))) {
        span = UINT64_MAX;  // past any arena
      }
      strides_.push_back(byte_strides[i] / item);
    }
    if (offset > arena_bytes || (!empty && span > arena_bytes - offset)) {
      Raise(Status::OutOfRange("a pool view of " + std::to_string(span) + " bytes at offset " +
                               std::to_string(offset) + " reaches past the pool's " +
                               std::to_string(arena_bytes) + " bytes"));
    }
    data_ = base + offset;
  }

  // A "dltensor" capsule (DLPack 0.6). Its DLManagedTensor owns copies of the shape and
  // strides and a reference to the manager; the consumer calls its deleter when done.
  py::capsule DlPack(const py::object& stream) const {
    if (!stream.is_none()) throw py::value_error("a pool is host memory: __dlpack__ takes no stream");
    struct Owned {
      DLManagedTensor t{};
      std::shared_ptr<CacheManager> keep;
      std::vector<int64_t> shape, strides;
    };
    auto* o = new Owned;
    o->keep = keep_;
    o->shape = shape_;
    o->strides = strides_;
    o->t.dl_tensor.data = data_;
    o->t.dl_tensor.device = {kDLCPU, 0};
    o->t.dl_tensor.ndim = static_cast<int>(shape_.size());
    o->t.dl_tensor.dtype = type_.dl;
    o->t.dl_tensor.shape = o->shape.data();
    o->t.dl_tensor.strides = o->strides.data();
    o->t.dl_tensor.byte_offset = 0;
    o->t.manager_ctx = o;
    o->t.deleter = [](DLManagedTensor* t) { delete static_cast<Owned*>(t->manager_ctx); };
    // A capsule no consumer took (still named "dltensor") frees it; a consumer renames it
    // "used_dltensor" and calls the deleter itself.
    PyObject* cap = PyCapsule_New(&o->t, "dltensor", [](PyObject* c) {
      if (PyCapsule_IsValid(c, "dltensor")) {
        auto* t = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(c, "dltensor"));
        t->deleter(t);
      }
    });
    if (cap == nullptr) {
      delete o;
      throw py::error_already_set();
    }
    return py::reinterpret_steal<py::capsule>(cap);
  }

  std::string dtype() const { return type_.name; }
  std::vector<int64_t> shape() const { return shape_; }
  std::vector<int64_t> strides() const { return strides_; }  // in elements, as DLPack's
  uintptr_t data_ptr() const { return reinterpret_cast<uintptr_t>(data_); }

 private:
  std::shared_ptr<CacheManager> keep_;
  ElementType type_;
  std::vector<int64_t> shape_, strides_;
  std::byte* data_ = nullptr;
};

// One KV event as Python sees it (kv_events.h).
struct PyKvEvent {
  std::string type;
  uint64_t sequence_number = 0;
  std::vector<std::string> kinds;
  std::vector<py::bytes> block_hashes;
  py::object parent_hash;  // bytes, or None for "all cleared"
  uint32_t block_tokens = 0;
};

// A subscription to a manager's KV events that Python drains: the listener only queues (it
// may run on any thread, the offload threads included, and never touches Python), so no
// thread ever waits for the GIL inside the manager. At most `max_events` wait; past that the
// oldest are dropped and counted, and a router resynchronises from `dropped`.
class PyEventQueue {
 public:
  PyEventQueue(std::shared_ptr<CacheManager> m, size_t max_events)
      : m_(std::move(m)), state_(std::make_shared<State>()) {
    if (max_events == 0) Raise(Status::InvalidArgument("max_events must be at least 1"));
    state_->max_events = max_events;
    std::weak_ptr<State> w = state_;
    id_ = m_->Subscribe([w](const KvEvent& e) {
      std::shared_ptr<State> st = w.lock();
      if (!st) return;
      {
        std::lock_guard<std::mutex> l(st->mu);
        if (st->events.size() == st->max_events) {
          st->events.pop_front();
          ++st->dropped;
        }
        st->events.push_back(e);
      }
      st->cv.notify_all();
    });
  }
  ~PyEventQueue() { Close(); }

  // The events waiting, oldest first (at most `max` when max > 0); with a timeout, waits up to
  // that long for the first one (the GIL released).
  std::vector<PyKvEvent> Drain(size_t max, double timeout_seconds) {
    std::deque<KvEvent> got;
    {
      py::gil_scoped_release unlocked;
      std::unique_lock<std::mutex> l(state_->mu);
      if (timeout_seconds > 0) {
        state_->cv.wait_for(l, std::chrono::duration<double>(timeout_seconds),
                            [&] { return !state_->events.empty() || state_->closed; });
      }
      const size_t n = max == 0 ? state_->events.size() : std::min(max, state_->events.size());
      for (size_t i = 0; i < n; ++i) {
        got.push_back(std::move(state_->events.front()));
        state_->events.pop_front();
      }
    }
    std::vector<PyKvEvent> out;
    for (const KvEvent& e : got) out.push_back(Convert(e));
    return out;
  }

  uint64_t dropped() const {
    std::lock_guard<std::mutex> l(state_->mu);
    return state_->dropped;
  }
  size_t pending() const {
    std::lock_guard<std::mutex> l(state_->mu);
    return state_->events.size();
  }

  // Ends the subscription; what is queued can still be drained.
  void Close() {
    if (m_) {
      m_->Unsubscribe(id_);
      m_.reset();
    }
    {
      std::lock_guard<std::mutex> l(state_->mu);
      state_->closed = true;
    }
    state_->cv.notify_all();
  }

 private:
  struct State {
    mutable std::mutex mu;
    std::condition_variable cv;
    std::deque<KvEvent> events;
    size_t max_events = 0;
    uint64_t dropped = 0;
    bool closed = false;
  };

  static PyKvEvent Convert(const KvEvent& e) {
    PyKvEvent p;
    p.type = std::string(KvEventTypeName(e.type));
    p.sequence_number = e.sequence_number;
    for (CacheKind k : e.kinds.Kinds()) p.kinds.emplace_back(CacheKindName(k));
    for (const BlockHash& h : e.block_hashes) p.block_hashes.push_back(HashBytes(h));
    p.parent_hash = e.type == KvEventType::kAllCleared ? py::none() : py::object(HashBytes(e.parent_hash));
    p.block_tokens = e.block_tokens;
    return p;
  }

  std::shared_ptr<CacheManager> m_;
  SubscriptionId id_ = 0;
  std::shared_ptr<State> state_;
};


// A CacheManager shared with every array lent out of its pools: an array keeps it alive.
class PyCacheManager {
 public:
  PyCacheManager(const ModelSpec& spec, uint32_t block_tokens, uint32_t capacity_blocks,
                 uint32_t window_capacity_blocks, uint32_t state_capacity_blocks, bool huge_pages,
                 const std::string& hash_mode, bool enable_prefix_caching, const std::string& eviction,
                 double hint_bound) {
    CacheManagerOptions o;
    o.eviction = Take(ParseEvictionPolicy(eviction));
    o.hint_bound = hint_bound;
    o.block_tokens = block_tokens;
    o.capacity_blocks = capacity_blocks;
    o.window_capacity_blocks = window_capacity_blocks;
    o.state_capacity_blocks = state_capacity_blocks;
    o.huge_pages = huge_pages;
    o.hash_mode = Take(ParseHashMode(hash_mode));
    o.enable_prefix_caching = enable_prefix_caching;
    m_ = std::shared_ptr<CacheManager>(Take(CacheManager::Create(spec, o)));
  }

  size_t num_pools() const { return m_->num_pools(); }
  uint32_t block_tokens() const { return m_->geometry().block_tokens; }

  py::dict PoolInfo(size_t i) const {
    CheckPool(i);
    const PoolGeometry& g = m_->geometry().pools[i];
    py::dict d;
    d["kind"] = std::string(CacheKindName(g.spec.kind));
    d["format"] = std::string(StorageFormatName(g.spec.format));
    d["dims"] = g.spec.dims;
    d["ratio"] = g.spec.ratio;
    d["layers"] = g.layers;
    d["entries_per_block"] = g.entries_per_block;
    d["bytes_per_entry"] = g.bytes_per_entry;
    d["page_bytes"] = g.page_bytes;
    d["layer_stride"] = g.layer_stride;
    d["block_stride"] = g.block_stride;
    d["capacity"] = m_->pool(i).capacity();
    return d;
  }

  // Pool i's arena in place: uint8 [capacity, page bytes], page p at row p (block_stride bytes:
  // every layer of one block). Writable; the array keeps the manager alive.
  py::array PoolArray(size_t i) const {
    CheckPool(i);
    const PagePool& pool = m_->pool(i);
    std::byte* base = pool.PageData(0);
    if (base == nullptr) Raise(Status::FailedPrecondition("the pool has no arena (metadata only)"));
    auto* keep = new std::shared_ptr<CacheManager>(m_);
    py::capsule owner(keep, [](void* p) { delete static_cast<std::shared_ptr<CacheManager>*>(p); });
    const py::ssize_t rows = pool.capacity(), cols = static_cast<py::ssize_t>(pool.page_bytes());
    return py::array(py::dtype::of<uint8_t>(), {rows, cols}, {cols, py::ssize_t{1}},
                     reinterpret_cast<uint8_t*>(base), owner);
  }

  // A view of pool i's arena for DLPack: `offset` bytes in, `shape` elements of `dtype` at
  // `byte_strides`, checked to stay inside the arena.
  PoolRegion Region(size_t i, uint64_t offset, const std::string& dtype, const std::vector<int64_t>& shape,
                    const std::vector<int64_t>& byte_strides) const {
    CheckPool(i);
    const PagePool& pool = m_->pool(i);
    std::byte* base = pool.PageData(0);
    if (base == nullptr) Raise(Status::FailedPrecondition("the pool has no arena (metadata only)"));
    return PoolRegion(m_, base, static_cast<uint64_t>(pool.capacity()) * pool.page_bytes(), offset, dtype, shape,
                      byte_strides);
  }

  // Evicts cached blocks no sequence holds (least recently used first) until every
  // full-history pool has `free_pages` free pages, at most `max_blocks`; their pages are
  // reused, their bytes dropped. Under a write-back OffloadedCache, its evict demotes them.
  uint32_t Evict(uint32_t free_pages, uint32_t max_blocks) {
    if (write_back_caches_->load() > 0) {
      Raise(Status::FailedPrecondition(
          "this manager has a write-back OffloadedCache: evict through it, so evicted blocks reach the tiers"));
    }
    CacheManager& m = *m_;
    py::gil_scoped_release unlocked;
    return m.EvictAhead(free_pages, max_blocks, [&m](HeldBlock b) { m.ReleaseHeldBlock(b); });
  }

  std::unique_ptr<PyEventQueue> Subscribe(size_t max_events) {
    return std::make_unique<PyEventQueue>(m_, max_events);
  }

  const std::shared_ptr<CacheManager>& manager() const { return m_; }
  // Write-back OffloadedCaches over this manager (at most one: it installs the eviction hook);
  // shared, since an OffloadedCache may outlive this object.
  const std::shared_ptr<std::atomic<int>>& write_back_caches() const { return write_back_caches_; }

  uint64_t CreateSequence(const std::string& salt, const std::string& extra_keys, bool cache_blocks) {
    SequenceOptions o;
    o.namespace_salt = salt;
    o.extra_keys = extra_keys;
    o.cache_blocks = cache_blocks;
    return Take(m_->CreateSequence(o));
  }

  void AppendTokens(uint64_t seq, const std::vector<TokenId>& tokens) {
    const Status st = m_->AppendTokens(seq, tokens);
    if (!st.ok()) Raise(st);
  }

  py::dict AcquireCachedPrefix(uint64_t seq) { return Match(Take(m_->AcquireCachedPrefix(seq))); }

  py::dict LookupPrefix(const std::vector<TokenId>& tokens, const std::string& salt, const std::string& extra_keys,
                        bool leave_last_token) const {
    PrefixQuery q;
    q.namespace_salt = salt;
    q.extra_keys = extra_keys;
    q.tokens = tokens;
    q.leave_last_token = leave_last_token;
    return Match(Take(m_->LookupPrefix(q)));
  }

  // A scheduler's hint: the prompt will be looked up soon (cache_manager.h, "Hints").
  py::dict HintPrefix(const std::vector<TokenId>& tokens, const std::string& salt, const std::string& extra_keys,
                      double ttl_seconds) {
    if (!(ttl_seconds > 0) || ttl_seconds > 365.0 * 86400) {
      Raise(Status::InvalidArgument("hint ttl of " + std::to_string(ttl_seconds) +
                                    " s; expected more than 0 and at most a year"));
    }
    PrefixQuery q;
    q.namespace_salt = salt;
    q.extra_keys = extra_keys;
    q.tokens = tokens;
    HintOptions ho;
    ho.ttl = std::chrono::milliseconds(std::max<int64_t>(1, static_cast<int64_t>(ttl_seconds * 1000)));
    const HintInfo h = Take(m_->HintPrefix(q, ho));
    py::dict d;
    d["id"] = h.id;
    d["found_blocks"] = h.found_blocks;
    d["protected_blocks"] = h.protected_blocks;
    return d;
  }
  void DropHint(uint64_t id) {
    const Status st = m_->DropHint(id);
    if (!st.ok()) Raise(st);
  }

  py::dict AllocateSlots(uint64_t seq, uint64_t num_tokens) {
    SlotAllocation a = Take(m_->AllocateSlots(seq, num_tokens));
    py::dict d;
    d["first_new_block"] = a.first_new_block;
    d["new_blocks"] = a.new_blocks;
    py::list copies;
    for (const PageCopy& c : a.copies) {
      copies.append(py::make_tuple(c.pool, c.src, c.dst,
                                   c.reason == CopyReason::kCopyOnWrite ? "copy_on_write" : "carry_state"));
    }
    d["copies"] = copies;
    return d;
  }

  void CommitComputed(uint64_t seq, uint64_t num_tokens) {
    const Status st = m_->CommitComputed(seq, num_tokens);
    if (!st.ok()) Raise(st);
  }

  void Free(uint64_t seq) {
    const Status st = m_->Free(seq);
    if (!st.ok()) Raise(st);
  }

  std::vector<PageId> BlockTable(uint64_t seq, size_t pool) const {
    std::vector<PageId> out;
    const Status st = m_->GetBlockTable(seq, pool, &out);
    if (!st.ok()) Raise(st);
    return out;
  }

  py::dict SequenceInfo(uint64_t seq) const {
    const sparsekv::SequenceInfo i = Take(m_->GetSequenceInfo(seq));
    py::dict d;
    d["tokens"] = i.tokens;
    d["computed_tokens"] = i.computed_tokens;
    d["slot_tokens"] = i.slot_tokens;
    d["blocks"] = i.blocks;
    d["cached_blocks"] = i.cached_blocks;
    return d;
  }

  void Reset() {
    const Status st = m_->Reset();
    if (!st.ok()) Raise(st);
  }

  py::dict Stats() const {
    const CacheStats s = m_->Stats();
    py::dict d;
    d["lookups"] = s.lookups;
    d["hits"] = s.hits;
    d["misses"] = s.misses;
    d["lookup_tokens"] = s.lookup_tokens;
    d["hit_tokens"] = s.hit_tokens;
    d["hit_blocks"] = s.hit_blocks;
    d["stored_blocks"] = s.stored_blocks;
    d["evicted_blocks"] = s.evicted_blocks;
    d["failed_allocations"] = s.failed_allocations;
    d["cached_blocks"] = s.cached_blocks;
    d["sequences"] = s.sequences;
    d["internal_errors"] = s.internal_errors;
    d["hints"] = s.hints;
    d["hinted_blocks"] = s.hinted_blocks;
    d["hints_expired"] = s.hints_expired;
    d["hint_blocks_cut"] = s.hint_blocks_cut;
    d["eviction"] = std::string(EvictionPolicyName(m_->options().eviction));
    return d;
  }

  // The Lightning Indexer over model layer `layer` of key pool `pool`, read in place: per token
  // the top_k entries of the target cache (its pages `target_table`, target_block_entries each;
  // empty: the key pages), as indices into that cache's pool (page * entries + slot).
  py::array Indexer(size_t pool, uint32_t layer, const py::array_t<float, py::array::c_style | py::array::forcecast>& q,
                    const py::array_t<float, py::array::c_style | py::array::forcecast>& weights,
                    const std::vector<uint32_t>& key_table, const std::vector<uint32_t>& target_table,
                    uint32_t target_block_entries, const std::vector<uint64_t>& positions, uint32_t top_k,
                    uint32_t key_ratio, uint32_t threads) const {
    CheckPool(pool);
    const PagedCacheView view = Take(PagedCacheView::ForLayer(m_->pool(pool), m_->geometry().pools[pool], layer));
    if (q.ndim() != 3 || weights.ndim() != 2 || q.shape(0) != weights.shape(0) || q.shape(1) != weights.shape(1) ||
        q.shape(2) != view.dims || positions.size() != static_cast<size_t>(q.shape(0))) {
      throw py::value_error("indexer: q is [tokens, heads, key dims], weights [tokens, heads], one position per token");
    }
    LightningIndexerOptions o;
    o.top_k = top_k;
    o.threads = threads;
    auto indexer = Take(LightningIndexer::Create(o));
    IndexerSequence is{key_table, target_table, target_block_entries};
    IndexerBatch b;
    b.q = q.data();
    b.q_type = RowType::kFp32;
    b.weights = weights.data();
    b.tokens = static_cast<uint32_t>(q.shape(0));
    b.heads = static_cast<uint32_t>(q.shape(1));
    b.sequences = std::span<const IndexerSequence>(&is, 1);
    b.positions = positions.data();
    b.key_ratio = key_ratio;
    py::array_t<int32_t> out({static_cast<py::ssize_t>(b.tokens), static_cast<py::ssize_t>(top_k)});
    IndexerOutput io;
    io.indices = out.mutable_data();
    Status st;
    {
      py::gil_scoped_release unlocked;
      st = indexer->Run(view, b, io);
    }
    if (!st.ok()) Raise(st);
    return out;
  }

  // Sparse MLA over model layer `layer` of pool `pool`, read in place: q [tokens, heads, D]
  // (float32, or uint16 holding bf16), indices [tokens, top_k] into the pool (page * entries +
  // slot, -1 for none). Returns (out [tokens, heads, 512] float32, lse [tokens, heads]).
  py::tuple Mla(size_t pool, uint32_t layer, const py::array& q,
                const py::array_t<int32_t, py::array::c_style | py::array::forcecast>& indices, float softmax_scale,
                uint32_t threads) const {
    CheckPool(pool);
    const PagedCacheView view = Take(PagedCacheView::ForLayer(m_->pool(pool), m_->geometry().pools[pool], layer));
    if (q.ndim() != 3 || !(q.flags() & py::array::c_style) || q.shape(2) != view.dims || indices.ndim() != 2 ||
        indices.shape(0) != q.shape(0)) {
      throw py::value_error("sparse_mla: q is C-contiguous [tokens, heads, dims], indices [tokens, top_k]");
    }
    SparseMlaOptions o;
    o.threads = threads;
    auto mla = Take(SparseMla::Create(o));
    SparseMlaBatch b;
    b.q = q.data();
    if (q.dtype().is(py::dtype::of<float>())) {
      b.q_type = RowType::kFp32;
    } else if (q.dtype().is(py::dtype::of<uint16_t>())) {
      b.q_type = RowType::kBf16;
    } else {
      throw py::type_error("sparse_mla: q is float32, or uint16 holding bf16");
    }
    b.tokens = static_cast<uint32_t>(q.shape(0));
    b.heads = static_cast<uint32_t>(q.shape(1));
    b.softmax_scale = softmax_scale;
    b.main.view = view;
    b.main.indices = indices.data();
    b.main.top_k = static_cast<uint32_t>(indices.shape(1));
    py::array_t<float> out({static_cast<py::ssize_t>(b.tokens), static_cast<py::ssize_t>(b.heads), py::ssize_t{512}});
    py::array_t<float> lse({static_cast<py::ssize_t>(b.tokens), static_cast<py::ssize_t>(b.heads)});
    Status st;
    {
      py::gil_scoped_release unlocked;
      st = mla->Run(b, {out.mutable_data(), lse.mutable_data()});
    }
    if (!st.ok()) Raise(st);
    return py::make_tuple(out, lse);
  }

  // For tests: a page's bytes as C++ reads them (copied), and a page filled from C++.
  py::bytes PageBytes(size_t pool, uint32_t page) const {
    CheckPage(pool, page);
    const PagePool& p = m_->pool(pool);
    return py::bytes(reinterpret_cast<const char*>(p.PageData(page)), p.page_bytes());
  }
  void FillPage(size_t pool, uint32_t page, uint8_t value) {
    CheckPage(pool, page);
    const PagePool& p = m_->pool(pool);
    std::memset(p.PageData(page), value, p.page_bytes());
  }

 private:
  static py::dict Match(const PrefixMatch& pm) {
    py::dict d;
    d["blocks"] = pm.blocks;
    d["tokens"] = pm.tokens;
    d["chain_blocks"] = pm.chain_blocks;
    return d;
  }
  void CheckPool(size_t i) const {
    if (i >= m_->num_pools()) {
      Raise(Status::OutOfRange("pool " + std::to_string(i) + " of " + std::to_string(m_->num_pools())));
    }
  }
  void CheckPage(size_t pool, uint32_t page) const {
    CheckPool(pool);
    if (page >= m_->pool(pool).capacity() || m_->pool(pool).PageData(0) == nullptr) {
      Raise(Status::OutOfRange("page " + std::to_string(page) + " of pool " + std::to_string(pool)));
    }
  }

  std::shared_ptr<CacheManager> m_;
  std::shared_ptr<std::atomic<int>> write_back_caches_ = std::make_shared<std::atomic<int>>(0);
};

// An OffloadedCache (offloaded_cache.h) over a CacheManager, with the tier chain it opens from
// the daemon's "offload" options. It keeps the manager alive; destroyed before its chain.
// ---- RequestLog ----

class PyRequestLog {
 public:
  PyRequestLog(const std::string& path, const std::string& durability, uint64_t segment_bytes,
               const std::string& recovery) {
    RequestLogOptions o;
    o.path = path;
    o.durability = Take(ParseDurability(durability));
    o.segment_bytes = segment_bytes;
    o.recovery = Take(ParseRequestLogRecovery(recovery));
    py::gil_scoped_release unlocked;
    log_ = Take(RequestLog::Open(o));
  }

  void Append(uint64_t request, uint64_t first_token, const std::vector<int64_t>& tokens) {
    std::vector<int32_t> t(tokens.size());
    for (size_t i = 0; i < tokens.size(); ++i) {
      if (tokens[i] < INT32_MIN || tokens[i] > INT32_MAX) {
        throw py::value_error("append: token " + std::to_string(tokens[i]) + " does not fit in 32 bits");
      }
      t[i] = static_cast<int32_t>(tokens[i]);
    }
    Status st;
    {
      py::gil_scoped_release unlocked;
      st = log()->Append(request, first_token, t);
    }
    if (!st.ok()) Raise(st);
  }

  void Suspended(uint64_t request, uint64_t tokens, const py::bytes& tail, uint64_t tag) {
    const std::string t = tail;
    if (t.size() != 16) throw py::value_error("suspended: the tail key is 16 bytes");
    RequestLog::Suspension s;
    s.tokens = tokens;
    std::memcpy(&s.tail.lo, t.data(), 8);
    std::memcpy(&s.tail.hi, t.data() + 8, 8);
    s.tag = tag;
    Status st;
    {
      py::gil_scoped_release unlocked;
      st = log()->Suspended(request, s);
    }
    if (!st.ok()) Raise(st);
  }

  void Finish(uint64_t request) {
    Status st;
    {
      py::gil_scoped_release unlocked;
      st = log()->Finish(request);
    }
    if (!st.ok()) Raise(st);
  }

  // [(id, tokens, (tokens, tail bytes, tag) or None)]
  py::list Recover() {
    py::list out;
    for (const RequestLog::Request& r : log()->Recover()) {
      py::object susp = py::none();
      if (r.suspension) {
        char tail[16];
        std::memcpy(tail, &r.suspension->tail.lo, 8);
        std::memcpy(tail + 8, &r.suspension->tail.hi, 8);
        susp = py::make_tuple(r.suspension->tokens, py::bytes(tail, 16), r.suspension->tag);
      }
      out.append(py::make_tuple(r.id, py::cast(r.tokens), susp));
    }
    return out;
  }

  py::dict Stats() {
    const RequestLogStats s = log()->Stats();
    py::dict d;
    d["appends"] = s.appends;
    d["tokens"] = s.tokens;
    d["commits"] = s.commits;
    d["syncs"] = s.syncs;
    d["bytes_written"] = s.bytes_written;
    d["segments"] = s.segments;
    d["segments_deleted"] = s.segments_deleted;
    d["live_requests"] = s.live_requests;
    d["torn_bytes_cut"] = s.torn_bytes_cut;
    d["damage_bytes_cut"] = s.damage_bytes_cut;
    d["damage_records_cut"] = s.damage_records_cut;
    d["damage_tokens_cut"] = s.damage_tokens_cut;
    return d;
  }

  void Close() {
    py::gil_scoped_release unlocked;
    log_.reset();
  }

 private:
  RequestLog* log() {
    if (!log_) Raise(Status::FailedPrecondition("the request log is closed"));
    return log_.get();
  }
  std::unique_ptr<RequestLog> log_;
};

class PyOffloadedCache {
 public:
  PyOffloadedCache(PyCacheManager& manager, const std::string& offload_json, const std::string& data_dir,
                   const std::string& write_policy, uint32_t namespace_id, uint64_t max_pending_demote_bytes,
                   uint32_t evict_ahead_blocks, int prefetch_blocks, uint32_t restore_threads,
                   bool demote_on_boundary_eviction)
      : m_(manager.manager()) {
    OffloadedCacheOptions o;
    o.namespace_id = namespace_id;
    o.write_policy = Take(ParseWritePolicy(write_policy));
    o.max_pending_demote_bytes = max_pending_demote_bytes;
    o.evict_ahead_blocks = evict_ahead_blocks;
    o.prefetch_blocks = prefetch_blocks;
    o.restore_threads = restore_threads;
    o.demote_on_boundary_eviction = demote_on_boundary_eviction;
    OffloadOptions oo = Take(ParseOffloadOptionsJson(offload_json));
    ResolveOffloadPaths(oo, data_dir);
    if (o.write_policy == WritePolicy::kWriteBack) {
      write_back_ = manager.write_back_caches();
      if (write_back_->fetch_add(1) != 0) {
        write_back_->fetch_sub(1);
        write_back_.reset();
        Raise(Status::FailedPrecondition("the manager already has a write-back OffloadedCache (one eviction hook)"));
      }
    }
    try {
      py::gil_scoped_release unlocked;
      chain_ = Take(OpenTierChain(oo));
      cache_ = std::make_unique<OffloadedCache>(*m_, *chain_, o);
    } catch (...) {
      if (write_back_ != nullptr) write_back_->fetch_sub(1);
      throw;
    }
  }

  ~PyOffloadedCache() {
    {
      py::gil_scoped_release unlocked;  // waits for the demotes in flight
      cache_.reset();
      chain_.reset();
    }
    if (write_back_ != nullptr) write_back_->fetch_sub(1);
  }

  uint64_t CreateSequence(const std::string& salt, const std::string& extra_keys, bool cache_blocks) {
    SequenceOptions o;
    o.namespace_salt = salt;
    o.extra_keys = extra_keys;
    o.cache_blocks = cache_blocks;
    return Take(cache_->CreateSequence(o));
  }
  void AppendTokens(uint64_t seq, const std::vector<TokenId>& tokens) { Check(cache_->AppendTokens(seq, tokens)); }
  py::dict AcquirePrefix(uint64_t seq) {
    Result<OffloadedPrefix> r = Status::Internal("");
    {
      py::gil_scoped_release unlocked;  // a restore reads the tiers
      r = cache_->AcquirePrefix(seq);
    }
    return Prefix(Take(std::move(r)));
  }
  void CommitComputed(uint64_t seq, uint64_t num_tokens) {
    Status st;
    {
      py::gil_scoped_release unlocked;  // write-through copies the new blocks out
      st = cache_->CommitComputed(seq, num_tokens);
    }
    Check(st);
  }
  void Free(uint64_t seq) { Check(cache_->Free(seq)); }
  py::dict LookupPrefix(const std::vector<TokenId>& tokens, const std::string& salt, const std::string& extra_keys,
                        bool leave_last_token) {
    PrefixQuery q;
    q.namespace_salt = salt;
    q.extra_keys = extra_keys;
    q.tokens = tokens;
    q.leave_last_token = leave_last_token;
    Result<OffloadedPrefix> r = Status::Internal("");
    {
      py::gil_scoped_release unlocked;
      r = cache_->LookupPrefix(q);
    }
    return Prefix(Take(std::move(r)));
  }
  std::vector<py::bytes> BlockDigests(uint64_t seq) const {
    std::vector<py::bytes> out;
    for (const BlockDigest& d : Take(cache_->BlockDigests(seq))) out.push_back(HashBytes(d.hash));
    return out;
  }
  uint32_t Evict(uint32_t free_pages, uint32_t max_blocks) {
    py::gil_scoped_release unlocked;
    return cache_->Evict(free_pages, max_blocks);
  }
  py::dict Suspend(uint64_t seq) {
    Result<SuspendInfo> r = Status::Internal("");
    {
      py::gil_scoped_release unlocked;  // waits for the chain's acknowledgement
      r = cache_->Suspend(seq);
    }
    const SuspendInfo i = Take(std::move(r));
    py::dict d;
    d["tail"] = HashBytes(i.tail);
    d["tokens"] = i.tokens;
    d["blocks"] = i.blocks;
    d["written_blocks"] = i.written_blocks;
    d["unsaved_blocks"] = i.unsaved_blocks;
    d["history_blocks"] = i.history_blocks;
    d["tail_bytes"] = i.tail_bytes;
    d["written_bytes"] = i.written_bytes;
    return d;
  }
  py::dict Resume(const std::vector<TokenId>& tokens, uint64_t state_tokens, const std::string& salt,
                  const std::string& extra_keys) {
    SequenceOptions o;
    o.namespace_salt = salt;
    o.extra_keys = extra_keys;
    Result<ResumeInfo> r = Status::Internal("");
    {
      py::gil_scoped_release unlocked;  // reads the tiers
      r = cache_->Resume(o, tokens, state_tokens);
    }
    const ResumeInfo i = Take(std::move(r));
    py::dict d;
    d["seq"] = i.seq;
    d["tokens"] = i.tokens;
    d["state_tokens"] = i.state_tokens;
    d["restored_tokens"] = i.restored_tokens;
    d["recompute_tokens"] = i.recompute_tokens;
    d["l1_blocks"] = i.l1_blocks;
    d["lower_blocks"] = i.lower_blocks;
    d["tail_restored"] = i.tail_restored;
    d["lost"] = i.lost;
    return d;
  }
  py::bytes SuspensionKey(const std::vector<TokenId>& tokens, uint64_t state_tokens, const std::string& salt,
                          const std::string& extra_keys) const {
    SequenceOptions o;
    o.namespace_salt = salt;
    o.extra_keys = extra_keys;
    return HashBytes(Take(cache_->SuspensionKey(o, tokens, state_tokens)));
  }
  void DropSuspension(const std::string& tail) {
    if (tail.size() != sizeof(BlockHash)) Raise(Status::InvalidArgument("a tail key is 16 bytes"));
    BlockHash h;
    std::memcpy(&h, tail.data(), sizeof h);
    Status st;
    {
      py::gil_scoped_release unlocked;
      st = cache_->DropSuspension(h);
    }
    Check(st);
  }
  void WaitIdle() {
    py::gil_scoped_release unlocked;
    cache_->WaitIdle();
  }

  py::dict Stats() const {
    const OffloadedCacheStats s = cache_->Stats();
    py::dict d;
    d["demoted_blocks"] = s.demoted_blocks;
    d["demote_failures"] = s.demote_failures;
    d["evicted_demoted"] = s.evicted_demoted;
    d["evicted_ahead"] = s.evicted_ahead;
    d["evicted_incomplete"] = s.evicted_incomplete;
    d["evicted_history"] = s.evicted_history;
    d["boundary_evictions_not_demoted"] = s.boundary_evictions_not_demoted;
    d["demote_backlog_drops"] = s.demote_backlog_drops;
    d["pending_demote_bytes"] = s.pending_demote_bytes;
    d["restored_blocks"] = s.restored_blocks;
    d["restore_rejected"] = s.restore_rejected;
    d["restore_other_pages"] = s.restore_other_pages;
    d["restore_untagged"] = s.restore_untagged;
    d["restore_no_room"] = s.restore_no_room;
    py::list tiers;
    for (size_t t = 0; t < chain_->tier_count(); ++t) {
      const Tier& tier = chain_->tier(t);
      const TierStats ts = tier.Stats();
      py::dict td;
      td["name"] = std::string(tier.name());
      td["items"] = ts.items;
      td["bytes"] = ts.bytes;
      td["capacity_bytes"] = ts.capacity_bytes;
      td["hits"] = ts.hits;
      td["misses"] = ts.misses;
      td["puts"] = ts.puts;
      td["put_failures"] = ts.put_failures;
      td["evictions"] = ts.evictions;
      td["corrupt"] = ts.corrupt;
      td["other_version"] = ts.other_version;
      td["io_errors"] = ts.io_errors;
      tiers.append(td);
    }
    d["tiers"] = tiers;
    return d;
  }

 private:
  static void Check(const Status& st) {
    if (!st.ok()) Raise(st);
  }
  static py::dict Prefix(const OffloadedPrefix& p) {
    py::dict d;
    d["l1_blocks"] = p.l1_blocks;
    d["lower_blocks"] = p.lower_blocks;
    d["blocks"] = p.blocks;
    d["tokens"] = p.tokens;
    return d;
  }

  std::shared_ptr<CacheManager> m_;
  std::shared_ptr<std::atomic<int>> write_back_;  // the manager's count, while this is one
  std::unique_ptr<TierChain> chain_;
  std::unique_ptr<OffloadedCache> cache_;
};

// The prefix-hash chain of a prompt's full blocks (block_hash.h), each as the 16 bytes the
// daemon files it under (lo, then hi, little-endian).
std::vector<py::bytes> BlockHashes(const std::vector<TokenId>& tokens, uint32_t block_tokens, const std::string& salt,
                                   const std::string& extra_keys, const std::string& mode) {
  if (block_tokens == 0) Raise(Status::InvalidArgument("block_tokens must be at least 1"));
  const BlockHasher hasher(Take(ParseHashMode(mode)), block_tokens);
  std::vector<BlockDigest> digests;
  hasher.HashFullBlocks(hasher.Root(salt), tokens, extra_keys, &digests);
  std::vector<py::bytes> out;
  out.reserve(digests.size());
  for (const BlockDigest& d : digests) out.push_back(HashBytes(d.hash));
  return out;
}

// A page codec on numpy: rows (float32, or bf16 as uint16) into slots of a page (any writable
// contiguous buffer of at least page_bytes: a numpy slice of a pool array, in place) and back.
// The SIMD path is chosen as in C++ (ActiveSimdPath).
class PyCodec {
 public:
  PyCodec(const std::string& format, uint32_t dims, uint32_t entries)
      : codec_(Take(PageCodec::Create(Take(ParseStorageFormat(format)), dims, entries))) {}

  uint64_t page_bytes() const { return codec_.page_bytes(); }
  uint32_t dims() const { return codec_.dims(); }
  uint32_t entries() const { return codec_.entries(); }
  std::string format() const { return std::string(StorageFormatName(codec_.format())); }

  void Write(const py::buffer& page, uint32_t first_slot, const py::array& rows) {
    py::buffer_info p = PageOf(page, /*writable=*/true);
    if (rows.ndim() != 2) throw py::value_error("rows must be 2-D [count, dims]");
    if (!(rows.flags() & py::array::c_style)) throw py::value_error("rows must be C-contiguous");
    const auto count = static_cast<uint32_t>(rows.shape(0));
    const auto dims = static_cast<uint32_t>(rows.shape(1));
    RowsView v;
    if (rows.dtype().is(py::dtype::of<float>())) {
      v = RowsView::Fp32(static_cast<const float*>(rows.data()), count, dims);
    } else if (rows.dtype().is(py::dtype::of<uint16_t>())) {
      v = RowsView::Bf16(static_cast<const uint16_t*>(rows.data()), count, dims);
    } else {
      throw py::type_error("rows must be float32, or uint16 holding bf16");
    }
    Status st;
    {
      py::gil_scoped_release unlocked;
      st = codec_.WriteTokens(p.ptr, first_slot, v);
    }
    if (!st.ok()) Raise(st);
  }

  py::array Read(const py::buffer& page, uint32_t first_slot, uint32_t count, const std::string& dtype) {
    py::buffer_info p = PageOf(page, /*writable=*/false);
    const bool bf16 = dtype == "bfloat16" || dtype == "bf16";
    if (!bf16 && dtype != "float32") throw py::value_error("dtype is float32 or bfloat16");
    py::array out = bf16 ? py::array(py::dtype::of<uint16_t>(), {count, codec_.dims()})
                         : py::array(py::dtype::of<float>(), {count, codec_.dims()});
    const MutableRowsView v = bf16 ? MutableRowsView::Bf16(static_cast<uint16_t*>(out.mutable_data()), count, codec_.dims())
                                   : MutableRowsView::Fp32(static_cast<float*>(out.mutable_data()), count, codec_.dims());
    Status st;
    {
      py::gil_scoped_release unlocked;
      st = codec_.ReadTokens(p.ptr, first_slot, v);
    }
    if (!st.ok()) Raise(st);
    return out;
  }

 private:
  py::buffer_info PageOf(const py::buffer& page, bool writable) const {
    py::buffer_info p = page.request(writable);
    if (p.ndim != 1 || p.itemsize != 1 || (p.ndim == 1 && p.strides[0] != 1)) {
      throw py::value_error("a page is a contiguous 1-D buffer of bytes (a slice of a pool array)");
    }
    if (static_cast<uint64_t>(p.size) < codec_.page_bytes()) {
      Raise(Status::InvalidArgument("a page of " + std::to_string(p.size) + " bytes; the codec's pages are " +
                                    std::to_string(codec_.page_bytes())));
    }
    return p;
  }

  PageCodec codec_;
};

ModelSpec Preset(const std::string& name, const std::string& precision) {
  return Take(ModelPreset(name, Take(ParseKvPrecision(precision))));
}

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

  RegisterValueType(m);

  py::class_<PyClient>(m, "_Client")
      .def(py::init<const std::string&, const std::string&, const std::string&, const std::string&, bool, double>(),
           py::arg("address"), py::arg("namespace"), py::arg("token"), py::arg("client_name"),
           py::arg("shared_memory"), py::arg("timeout"))
      .def("put", &PyClient::Put)
      .def("get", &PyClient::Get)
      .def("get_into", &PyClient::GetInto)
      .def("get_views", &PyClient::GetViews)
      .def("lookup", &PyClient::Lookup)
      .def("lookup_array", &PyClient::LookupArray, py::arg("keys"))
      .def("get_into_pieces", &PyClient::GetIntoPieces, py::arg("keys"), py::arg("ptrs"), py::arg("sizes"),
           py::arg("counts"))
      .def("put_pieces", &PyClient::PutPieces, py::arg("keys"), py::arg("ptrs"), py::arg("sizes"), py::arg("counts"))
      .def("delete", &PyClient::Delete)
      .def("hint", &PyClient::Hint, py::arg("keys"), py::arg("ttl"))
      .def("drop_hint", &PyClient::DropHint, py::arg("hint"))
      .def("log_append", &PyClient::LogAppend)
      .def("log_suspended", &PyClient::LogSuspended)
      .def("log_finish", &PyClient::LogFinish)
      .def("log_recover", &PyClient::LogRecover)
      .def("stats", &PyClient::Stats)
      .def("ping", &PyClient::Ping)
      .def("close", &PyClient::Close)
      .def_property_readonly("shared_memory", &PyClient::shared_memory)
      .def_property_readonly("max_payload_bytes", &PyClient::max_payload_bytes)
      .def_property_readonly("block_tokens", &PyClient::block_tokens)
      .def_property_readonly("session_id", &PyClient::session_id);


  py::class_<sparsekv::ModelSpec>(m, "ModelSpec")
      .def_readonly("name", &sparsekv::ModelSpec::name)
      .def_property_readonly("num_layers", [](const sparsekv::ModelSpec& s) { return s.layers.size(); })
      .def("to_json", [](const sparsekv::ModelSpec& s) { return sparsekv::ModelSpecToJson(s); })
      .def("__repr__", [](const sparsekv::ModelSpec& s) {
        return "sparsekv.ModelSpec(" + s.name + ", " + std::to_string(s.layers.size()) + " layers)";
      });
  m.def("model_preset", &Preset, py::arg("name"), py::arg("precision") = "bf16");
  m.def(
      "_offload_options_json",
      [](const std::string& text) -> std::string {
        return sparsekv::OffloadOptionsToJson(Take(sparsekv::ParseOffloadOptionsJson(text)));
      },
      py::arg("offload_json"),
      "The daemon's \"offload\" section parsed and written back with every key (offload_options.h): what "
      "the configuration reference is checked against.");
  m.def("model_presets", &sparsekv::ModelPresetNames);
  m.def(
      "_plan_for_sequences",
      [](const sparsekv::ModelSpec& spec, uint32_t block_tokens, uint64_t batch, uint64_t seq_len) {
        return sparsekv::MemoryPlanToJson(Take(sparsekv::PlanForSequences(spec, block_tokens, batch, seq_len)));
      },
      py::arg("spec"), py::arg("block_tokens"), py::arg("batch"), py::arg("seq_len"));
  m.def(
      "_plan_for_budget",
      [](const sparsekv::ModelSpec& spec, uint32_t block_tokens, uint64_t budget_bytes, uint64_t batch) {
        return sparsekv::MemoryPlanToJson(Take(sparsekv::PlanForBudget(spec, block_tokens, budget_bytes, batch)));
      },
      py::arg("spec"), py::arg("block_tokens"), py::arg("budget_bytes"), py::arg("batch"));
  m.def("block_hashes", &BlockHashes, py::arg("tokens"), py::arg("block_tokens"), py::arg("namespace_salt") = "",
        py::arg("extra_keys") = "", py::arg("mode") = "xxh3");
  m.def("model_spec_from_json", [](const std::string& text) { return Take(sparsekv::ParseModelSpecJson(text)); },
        py::arg("text"));

  py::class_<PyCacheManager>(m, "_CacheManager")
      .def(py::init<const sparsekv::ModelSpec&, uint32_t, uint32_t, uint32_t, uint32_t, bool, const std::string&,
                    bool, const std::string&, double>(),
           py::arg("spec"), py::arg("block_tokens"), py::arg("capacity_blocks"), py::arg("window_capacity_blocks"),
           py::arg("state_capacity_blocks"), py::arg("huge_pages"), py::arg("hash_mode"),
           py::arg("enable_prefix_caching"), py::arg("eviction"), py::arg("hint_bound"))
      .def("hint_prefix", &PyCacheManager::HintPrefix)
      .def("drop_hint", &PyCacheManager::DropHint)
      .def_property_readonly("num_pools", &PyCacheManager::num_pools)
      .def_property_readonly("block_tokens", &PyCacheManager::block_tokens)
      .def("pool_info", &PyCacheManager::PoolInfo)
      .def("pool_array", &PyCacheManager::PoolArray)
      .def("create_sequence", &PyCacheManager::CreateSequence)
      .def("append_tokens", &PyCacheManager::AppendTokens)
      .def("acquire_cached_prefix", &PyCacheManager::AcquireCachedPrefix)
      .def("lookup_prefix", &PyCacheManager::LookupPrefix)
      .def("allocate_slots", &PyCacheManager::AllocateSlots)
      .def("commit_computed", &PyCacheManager::CommitComputed)
      .def("free", &PyCacheManager::Free)
      .def("block_table", &PyCacheManager::BlockTable)
      .def("sequence_info", &PyCacheManager::SequenceInfo)
      .def("reset", &PyCacheManager::Reset)
      .def("stats", &PyCacheManager::Stats)
      .def("lightning_indexer", &PyCacheManager::Indexer, py::arg("pool"), py::arg("layer"), py::arg("q"),
           py::arg("weights"), py::arg("key_table"), py::arg("target_table"), py::arg("target_block_entries"),
           py::arg("positions"), py::arg("top_k"), py::arg("key_ratio"), py::arg("threads"))
      .def("sparse_mla", &PyCacheManager::Mla, py::arg("pool"), py::arg("layer"), py::arg("q"), py::arg("indices"),
           py::arg("softmax_scale"), py::arg("threads"))
      .def("region", &PyCacheManager::Region, py::arg("pool"), py::arg("offset"), py::arg("dtype"), py::arg("shape"),
           py::arg("byte_strides"))
      .def("evict", &PyCacheManager::Evict, py::arg("free_pages"), py::arg("max_blocks"))
      .def("subscribe", &PyCacheManager::Subscribe, py::arg("max_events"))
      .def("_page_bytes", &PyCacheManager::PageBytes)
      .def("_fill_page", &PyCacheManager::FillPage);
  py::class_<PoolRegion>(m, "PoolRegion",
                         "A strided view of a pool's memory for DLPack consumers (torch.from_dlpack, "
                         "numpy.from_dlpack): no copy, and what is made of it keeps the pool alive.")
      .def("__dlpack__", &PoolRegion::DlPack, py::arg("stream") = py::none())
      .def("__dlpack_device__", [](const PoolRegion&) { return py::make_tuple(static_cast<int>(kDLCPU), 0); })
      .def_property_readonly("dtype", &PoolRegion::dtype)
      .def_property_readonly("shape", &PoolRegion::shape)
      .def_property_readonly("strides", &PoolRegion::strides, "In elements, as DLPack's.")
      .def_property_readonly("data_ptr", &PoolRegion::data_ptr);
  py::class_<PyKvEvent>(m, "KvEvent", "One change to the blocks a cache manager holds (kv_events.h).")
      .def_readonly("type", &PyKvEvent::type, "\"blocks_stored\", \"blocks_removed\" or \"all_cleared\".")
      .def_readonly("sequence_number", &PyKvEvent::sequence_number, "1, 2, 3, ... in the manager's stream.")
      .def_readonly("kinds", &PyKvEvent::kinds, "Stored: the kinds written; removed: the kinds the blocks lost.")
      .def_readonly("block_hashes", &PyKvEvent::block_hashes,
                    "16 bytes each (the keys sparsekvd files the blocks under); stored: consecutive, in order.")
      .def_readonly("parent_hash", &PyKvEvent::parent_hash,
                    "Stored: the block before block_hashes[0] (the namespace root for block 0).")
      .def_readonly("block_tokens", &PyKvEvent::block_tokens)
      .def("__repr__", [](const PyKvEvent& e) {
        return "sparsekv.KvEvent(" + e.type + ", #" + std::to_string(e.sequence_number) + ", " +
               std::to_string(e.block_hashes.size()) + " blocks)";
      });
  py::class_<PyEventQueue>(m, "_EventQueue")
      .def("drain", &PyEventQueue::Drain, py::arg("max") = 0, py::arg("timeout") = 0.0)
      .def_property_readonly("dropped", &PyEventQueue::dropped)
      .def_property_readonly("pending", &PyEventQueue::pending)
      .def("close", &PyEventQueue::Close);
  py::class_<PyRequestLog>(m, "_RequestLog")
      .def(py::init<const std::string&, const std::string&, uint64_t, const std::string&>(), py::arg("path"),
           py::arg("durability"), py::arg("segment_bytes"), py::arg("recovery") = "tolerate_torn_tail")
      .def("append", &PyRequestLog::Append)
      .def("suspended", &PyRequestLog::Suspended)
      .def("finish", &PyRequestLog::Finish)
      .def("recover", &PyRequestLog::Recover)
      .def("stats", &PyRequestLog::Stats)
      .def("close", &PyRequestLog::Close);

  py::class_<PyOffloadedCache>(m, "_OffloadedCache")
      .def(py::init<PyCacheManager&, const std::string&, const std::string&, const std::string&, uint32_t, uint64_t,
                    uint32_t, int, uint32_t, bool>(),
           py::arg("manager"), py::arg("offload_json"), py::arg("data_dir"), py::arg("write_policy"),
           py::arg("namespace_id"), py::arg("max_pending_demote_bytes"), py::arg("evict_ahead_blocks"),
           py::arg("prefetch_blocks"), py::arg("restore_threads"), py::arg("demote_on_boundary_eviction"))
      .def("create_sequence", &PyOffloadedCache::CreateSequence)
      .def("append_tokens", &PyOffloadedCache::AppendTokens)
      .def("acquire_prefix", &PyOffloadedCache::AcquirePrefix)
      .def("commit_computed", &PyOffloadedCache::CommitComputed)
      .def("free", &PyOffloadedCache::Free)
      .def("lookup_prefix", &PyOffloadedCache::LookupPrefix)
      .def("block_digests", &PyOffloadedCache::BlockDigests)
      .def("evict", &PyOffloadedCache::Evict)
      .def("suspend", &PyOffloadedCache::Suspend)
      .def("resume", &PyOffloadedCache::Resume)
      .def("suspension_key", &PyOffloadedCache::SuspensionKey)
      .def("drop_suspension", &PyOffloadedCache::DropSuspension)
      .def("wait_idle", &PyOffloadedCache::WaitIdle)
      .def("stats", &PyOffloadedCache::Stats);
  py::class_<PyCodec>(m, "_Codec")
      .def(py::init<const std::string&, uint32_t, uint32_t>(), py::arg("format"), py::arg("dims"),
           py::arg("entries"))
      .def_property_readonly("page_bytes", &PyCodec::page_bytes)
      .def_property_readonly("dims", &PyCodec::dims)
      .def_property_readonly("entries", &PyCodec::entries)
      .def_property_readonly("format", &PyCodec::format)
      .def("write", &PyCodec::Write, py::arg("page"), py::arg("first_slot"), py::arg("rows"),
           "Encodes rows (float32, or uint16 holding bf16) [count, dims] into slots first_slot.. of the page "
           "(a writable contiguous uint8 buffer, e.g. a slice of a pool array), in place.")
      .def("read", &PyCodec::Read, py::arg("page"), py::arg("first_slot"), py::arg("count"),
           py::arg("dtype") = "float32",
           "Decodes slots first_slot.. of the page into a new array [count, dims] of float32 (or uint16 bf16).");
  py::class_<CppBaseline>(m, "_CppBaseline")
      .def(py::init<const std::string&, const std::string&, const std::string&, bool>(), py::arg("address"),
           py::arg("namespace"), py::arg("token"), py::arg("shared_memory"))
      .def("get_loop", &CppBaseline::GetLoop, py::arg("keys"), py::arg("iterations"))
      .def("get_into_loop", &CppBaseline::GetIntoLoop, py::arg("keys"), py::arg("out"), py::arg("iterations"));
}
