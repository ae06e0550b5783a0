// strata_stream._core: the pybind11 face of the engine. Thin on purpose: argument conversion,
// GIL release around every wait, and errors mapped onto strata_stream.errors. Every binding
// validates its own arguments (ndim, shape, dtype, contiguity, ranges): the Python wrappers are
// a convenience, not a guard. Calls with many options take them as keywords only, so two flags
// can never be swapped by position.
#include <pybind11/native_enum.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <climits>
#include <cmath>
#include <cstring>
#include <memory>
#include <optional>

#include "common/errors.h"
#include "residency/expert_stream.h"
#include "residency/stream_testing.h"
#include "kernel_bench.h"
#include "raw_read_bench.h"
#include "backends.h"
#include "exec/backend_registry.h"
#include "exec/window.h"
#include "pack/checksum.h"

namespace py = pybind11;
using namespace strata;

namespace {

// Polled by blocking waits (without the engine lock): lets Ctrl-C interrupt them.
void check_signals() {
  py::gil_scoped_acquire gil;
  if (PyErr_CheckSignals() != 0) throw py::error_already_set();
}

// The engine's stream behind a Python object. Its IO threads are told to stop when the object
// goes; one stuck in a read keeps the stream (and its arena) alive on a background thread until
// the read returns, instead of blocking the garbage collector with the GIL held.
struct Stream {
  std::unique_ptr<ExpertStream> s;

  Stream() = default;
  explicit Stream(std::unique_ptr<ExpertStream> p) : s(std::move(p)) {}
  Stream(Stream&&) = default;
  ~Stream() {
    if (!s) return;
    const double bound = s->closed() ? 0.0 : 0.25;  // a closed one already waited its bound
    ExpertStream::dispose(std::move(s), bound);
  }

  ExpertStream& get() {
    if (!s) throw EngineError(ErrorKind::Closed, "ExpertStream is closed");
    return *s;
  }
};

// Destroys a Window without the GIL: its destructor may wait for the stream's close() to finish
// calling close hooks, and another Window's layer in flight needs the GIL to poll for Ctrl-C.
struct WindowDeleter {
  void operator()(Window* w) const {
    if (Py_IsInitialized() && PyGILState_Check()) {
      py::gil_scoped_release nogil;
      delete w;
    } else {
      delete w;
    }
  }
};
using WindowHolder = std::unique_ptr<Window, WindowDeleter>;

std::string dtype_name(const py::array& a) { return py::str(a.dtype()).cast<std::string>(); }

// Expert ids from a 0-d or 1-d integer array (or a sequence), copied while the GIL is held so
// that another thread writing the caller's array cannot change them after they were checked.
// Ranges against the pack (layer, n_experts) are the engine's to check; here: representable.
std::vector<std::int32_t> ids_arg(const py::handle& obj, const char* what) {
  py::array a = py::array::ensure(obj);
  if (!a) throw py::type_error(std::string(what) + ": expected an array of expert ids");
  if (a.ndim() > 1)
    throw py::value_error(std::string(what) + ": expected a 1-D array of expert ids, got " +
                          std::to_string(a.ndim()) + " dimensions");
  if (a.size() == 0) return {};
  const char kind = a.dtype().kind();
  if (kind != 'i' && kind != 'u')
    throw py::type_error(std::string(what) + ": expert ids must be integers, got dtype " +
                         dtype_name(a));
  auto wide = py::array_t<std::int64_t, py::array::c_style | py::array::forcecast>::ensure(a);
  if (!wide) throw py::type_error(std::string(what) + ": expert ids must fit in int64");
  std::vector<std::int32_t> out(std::size_t(wide.size()));
  const std::int64_t* v = wide.data();
  for (std::size_t i = 0; i < out.size(); ++i) {
    if (v[i] < 0 || v[i] > INT32_MAX)
      throw py::index_error(std::string(what) + ": expert " + std::to_string(v[i]) +
                            " out of range");
    out[i] = std::int32_t(v[i]);
  }
  return out;
}

void require_finite_positive(double v, const char* what) {
  if (!(v > 0) || !std::isfinite(v))
    throw EngineError(ErrorKind::Config,
                      std::string(what) + " must be positive and finite, got " + std::to_string(v));
}

py::dict layout_dict(const PackLayout& L) {
  py::dict d;
  d["n_layers"] = L.n_layers;
  d["n_experts"] = L.n_experts;
  d["top_k"] = L.top_k;
  d["hidden"] = L.hidden;
  d["moe_intermediate"] = L.moe_intermediate;
  d["routing"] = L.routing == Routing::SoftmaxTopk   ? "softmax_topk"
                 : L.routing == Routing::TopkSoftmax ? "topk_softmax"
                                                     : "external";
  d["activation"] = L.activation == Activation::SwiGLU ? "swiglu" : "swiglu_oai";
  d["bias_format"] = L.bias_format;
  d["norm_topk_prob"] = L.norm_topk_prob;
  d["weight_format"] = static_cast<std::uint32_t>(L.weight_format);
  d["group_size"] = L.group_size;
  d["record_bytes"] = L.record_bytes;
  d["record_stride"] = L.record_stride;
  d["records_offset"] = L.records_offset;
  d["file_bytes"] = L.file_bytes;
  return d;
}

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "strata-stream engine (C++)";
  strata::python::bind_backends(m);

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const ExpertReadError& e) {
      py::module_ errors = py::module_::import("strata_stream.errors");
      py::object exc = errors.attr("ExpertReadError")(e.err, e.what());
      exc.attr("layer") = e.layer;
      exc.attr("expert") = e.expert;
      exc.attr("offset") = e.offset;
      PyErr_SetObject(errors.attr("ExpertReadError").ptr(), exc.ptr());
    } catch (const EngineError& e) {
      const char* name = "StrataError";
      switch (e.kind()) {
        case ErrorKind::Pack: name = "PackError"; break;
        case ErrorKind::Config: name = "ConfigError"; break;
        case ErrorKind::ExpertRead: name = "ExpertReadError"; break;
        case ErrorKind::Closed: name = "StreamClosedError"; break;
        case ErrorKind::Timeout: name = "StreamTimeoutError"; break;
        case ErrorKind::ArenaFull: name = "ArenaFullError"; break;
        case ErrorKind::Turn: name = "TurnError"; break;
      }
      py::object cls = py::module_::import("strata_stream.errors").attr(name);
      PyErr_SetString(cls.ptr(), e.what());
    }
  });

  m.attr("ABSENT") = kAbsent;
  py::native_enum<ReadClass>(m, "ReadClass", "enum.IntEnum",
                             "Why a read was issued; the IO queue serves lower values first.")
      .value("URGENT", ReadClass::Urgent)
      .value("PRED1", ReadClass::Pred1)
      .value("PRED2", ReadClass::Pred2)
      .value("PROFILE", ReadClass::Profile)
      .finalize();
  py::native_enum<SlotState>(m, "SlotState", "enum.IntEnum", "An arena slot's state (slot.h).")
      .value("FREE", SlotState::Free)
      .value("QUEUED", SlotState::Queued)
      .value("READING", SlotState::Reading)
      .value("COMPLETE", SlotState::Complete)
      .value("LIMBO", SlotState::Limbo)
      .value("FAILED", SlotState::Failed)
      .finalize();
  m.def("crc32", [](py::buffer b) {
    py::buffer_info info = b.request();
    return crc32_bytes(info.ptr, std::size_t(info.size * info.itemsize));
  });
  m.def("disposing", &ExpertStream::disposing,
        "Closed streams a background thread still waits to free (a read was stuck).");
  m.def("read_layout", [](const std::string& path) { return layout_dict(read_pack_layout(path)); });

  py::class_<Stream>(m, "Stream")
      .def(py::init([](const std::string& path, std::uint64_t arena_bytes, std::uint32_t io_threads,
                       std::uint64_t part_bytes, bool direct_io, bool verify_reads,
                       double io_timeout_s, bool publish_prefetch, bool simulate_io,
                       const std::string& eviction) {
             if (arena_bytes == 0) throw EngineError(ErrorKind::Config, "arena_bytes must be positive");
             if (io_threads > 256)
               throw EngineError(ErrorKind::Config, "io_threads must be 0..256, got " +
                                                        std::to_string(io_threads));
             require_finite_positive(io_timeout_s, "io_timeout_s");
             StreamOptions o;
             o.arena_bytes = arena_bytes;
             o.io_threads = io_threads;
             o.part_bytes = part_bytes;
             o.direct_io = direct_io;
             o.verify_reads = verify_reads;
             o.io_timeout_s = io_timeout_s;
             o.publish_prefetch = publish_prefetch;
             o.simulate_io = simulate_io;
             auto policy = parse_eviction_policy(eviction);
             if (!policy)
               throw EngineError(ErrorKind::Config,
                                 "unknown eviction policy '" + eviction + "' (lru, decayed_lfu)");
             o.eviction = *policy;
             py::gil_scoped_release nogil;
             return Stream{std::make_unique<ExpertStream>(path, o)};
           }),
           py::arg("path"), py::kw_only(), py::arg("arena_bytes"), py::arg("io_threads"),
           py::arg("part_bytes"), py::arg("direct_io"), py::arg("verify_reads"),
           py::arg("io_timeout_s"), py::arg("publish_prefetch"), py::arg("simulate_io") = false,
           py::arg("eviction") = "decayed_lfu")
      // Closes the Windows on the stream first (each waits for its layer in flight), then stops
      // the IO threads, waiting at most io_timeout_s for a read in flight: a stuck one is left to
      // finish on its own (the arena stays alive for it) with a RuntimeWarning naming it.
      .def("close",
           [](Stream& self) {
             if (!self.s) return;
             ExpertStream& s = *self.s;
             bool joined;
             {
               py::gil_scoped_release nogil;
               joined = s.close(s.options().io_timeout_s);
             }
             if (!joined) {
               const std::string msg =
                   "ExpertStream.close(): an IO thread is still inside a read after "
                   "io_timeout_s = " + std::to_string(s.options().io_timeout_s) +
                   " s (" + s.describe_in_flight() +
                   "); the stream is closed and its memory is kept until the read returns";
               if (PyErr_WarnEx(PyExc_RuntimeWarning, msg.c_str(), 1) != 0)
                 throw py::error_already_set();
             }
           })
      .def_property_readonly("closed", [](Stream& self) { return !self.s || self.s->closed(); })
      .def_property_readonly("n_clients", [](Stream& self) { return self.get().n_clients(); })
      .def_property_readonly("clients_waiting_for_space",
                             [](Stream& self) { return self.get().clients_waiting_for_space(); })
      .def_property_readonly("n_slots", [](Stream& self) { return self.get().n_slots(); })
      .def_property_readonly("n_parts", [](Stream& self) { return self.get().n_parts(); })
      .def_property_readonly("layout", [](Stream& self) { return layout_dict(self.get().layout()); })
      .def_property_readonly("direct_io", [](Stream& self) { return self.get().file().direct(); })
      .def_property_readonly("direct_note",
                             [](Stream& self) { return self.get().file().direct_note(); })
      .def("request",
           [](Stream& self, std::uint32_t layer, const py::object& experts, ReadClass cls) {
             auto& s = self.get();
             const std::vector<std::int32_t> ids = ids_arg(experts, "request");
             RequestResult r;
             {
               py::gil_scoped_release nogil;
               r = s.request(layer, ids.data(), ids.size(), cls, check_signals);
             }
             return py::make_tuple(r.hits, r.misses, r.dropped);
           },
           py::arg("layer"), py::arg("experts"), py::arg("cls"))
      .def("wait",
           [](Stream& self, std::uint32_t layer, const py::object& experts) {
             auto& s = self.get();
             const std::vector<std::int32_t> ids = ids_arg(experts, "wait");
             py::gil_scoped_release nogil;
             s.wait(layer, ids.data(), ids.size(), check_signals);
           },
           py::arg("layer"), py::arg("experts"))
      .def("publish",
           [](Stream& self, std::uint32_t layer) {
             auto& s = self.get();
             py::gil_scoped_release nogil;
             return s.publish(layer);
           })
      .def("enter_layer",
           [](Stream& self, std::uint32_t l, const py::object& experts) {
             if (experts.is_none()) {
               self.get().enter_layer(l);
               return;
             }
             // A list, even an empty one, protects exactly its experts.
             const std::vector<std::int32_t> ids = ids_arg(experts, "enter_layer");
             self.get().enter_layer(l, ids.data(), ids.size());
           },
           py::arg("layer"), py::arg("experts") = py::none())
      .def("after_layer", [](Stream& self, std::uint32_t l) { self.get().after_layer(l); })
      .def("end_turn", [](Stream& self) { self.get().end_turn(); })
      .def("plan",
           [](Stream& self, std::uint32_t layer, const py::object& experts) {
             const std::vector<std::int32_t> ids = ids_arg(experts, "plan");
             py::array_t<std::uint8_t> out(py::ssize_t(ids.size()));
             self.get().plan(layer, ids.data(), ids.size(), out.mutable_data());
             return out;
           },
           py::arg("layer"), py::arg("experts"))
      .def("release_plan", [](Stream& self) { self.get().release_plan(); })
      .def("cancel", [](Stream& self, std::uint32_t l, std::uint32_t e) { return self.get().cancel(l, e); })
      .def("retire_unused_pre",
           [](Stream& self, std::uint32_t layer, const py::object& chosen) {
             const std::vector<std::int32_t> ids = ids_arg(chosen, "retire_unused_pre");
             return self.get().retire_unused_pre(layer, ids.data(), ids.size());
           },
           py::arg("layer"), py::arg("chosen"))
      .def("release_limbo", [](Stream& self) { return self.get().release_limbo(); })
      .def("victim", [](Stream& self, bool spec) { return StreamTesting::victim(self.get(), spec); },
           py::arg("speculative") = false)
      .def("evict_one", [](Stream& self) { return StreamTesting::evict_one(self.get()); })
      .def("pending_jobs",
           [](Stream& self) {
             py::list out;
             for (const JobInfo& j : StreamTesting::pending_jobs(self.get()))
               out.append(py::make_tuple(j.slot, j.key, j.part, int(j.cls)));
             return out;
           })
      .def("run_job",
           [](Stream& self, std::size_t i) {
             auto& s = self.get();
             py::gil_scoped_release nogil;
             return StreamTesting::run_job(s, i);
           })
      .def("inject_fault",
           [](Stream& self, std::uint32_t key, int part, int kind, int err, int count,
              int delay_ms) {
             auto& s = self.get();
             if (key >= s.layout().n_keys())
               throw py::index_error("inject_fault: key " + std::to_string(key) +
                                     " out of range [0, " + std::to_string(s.layout().n_keys()) +
                                     ")");
             if (part < -1 || part >= int(s.n_parts()))
               throw py::index_error("inject_fault: part " + std::to_string(part) +
                                     " out of range [-1, " + std::to_string(s.n_parts()) + ")");
             if (kind < 0 || kind > 2)
               throw py::value_error("inject_fault: kind must be 0 (errno), 1 (short) or 2 (delay)");
             if (count < -1) throw py::value_error("inject_fault: count must be >= -1 (-1 = always)");
             if (delay_ms < 0) throw py::value_error("inject_fault: delay_ms must be >= 0");
             Fault f;
             f.kind = static_cast<FaultKind>(kind);
             f.err = err;
             f.delay_ms = delay_ms;
             f.remaining = count;
             StreamTesting::faults(s).add(key, part, f);
           },
           py::kw_only(), py::arg("key"), py::arg("part"), py::arg("kind"), py::arg("err"),
           py::arg("count"), py::arg("delay_ms"))
      .def("clear_faults", [](Stream& self) { StreamTesting::faults(self.get()).clear(); })
      .def_property_readonly("smap",
                             [](py::object obj) {
                               Stream& self = obj.cast<Stream&>();
                               auto& s = self.get();
                               py::array_t<std::uint32_t> a(
                                   {py::ssize_t(s.layout().n_keys())}, {sizeof(std::uint32_t)},
                                   s.smap(), obj);
                               py::detail::array_proxy(a.ptr())->flags &=
                                   ~py::detail::npy_api::NPY_ARRAY_WRITEABLE_;
                               return a;
                             })
      .def("key", [](Stream& self, std::int64_t layer,
                     std::int64_t expert) { return self.get().key(layer, expert); })
      .def("where", [](Stream& self, std::int64_t layer,
                       std::int64_t expert) { return self.get().where(layer, expert); })
      .def("slot_bytes",
           [](py::object obj, std::uint32_t slot) {
             Stream& self = obj.cast<Stream&>();
             auto& s = self.get();
             if (slot >= s.n_slots()) throw std::out_of_range("slot out of range");
             py::array_t<std::uint8_t> a({py::ssize_t(s.layout().record_bytes)}, {1},
                                         s.arena().slot(slot), obj);
             py::detail::array_proxy(a.ptr())->flags &=
                 ~py::detail::npy_api::NPY_ARRAY_WRITEABLE_;
             return a;
           })
      .def("slots",
           [](Stream& self) {
             auto v = self.get().slots();
             std::size_t n = v.size();
             py::array_t<std::uint32_t> key(n), pins(n);
             py::array_t<std::uint8_t> state(n), cls(n), published(n), failed(n);
             py::array_t<std::uint16_t> total(n), started(n), done(n);
             py::array_t<std::uint64_t> last_use(n);
             for (std::size_t i = 0; i < n; ++i) {
               key.mutable_at(i) = v[i].key;
               pins.mutable_at(i) = v[i].pins;
               state.mutable_at(i) = std::uint8_t(v[i].state);
               cls.mutable_at(i) = std::uint8_t(v[i].cls);
               published.mutable_at(i) = v[i].published;
               failed.mutable_at(i) = v[i].failed;
               total.mutable_at(i) = v[i].parts_total;
               started.mutable_at(i) = v[i].parts_started;
               done.mutable_at(i) = v[i].parts_done;
               last_use.mutable_at(i) = v[i].last_use;
             }
             py::dict d;
             d["key"] = key; d["state"] = state; d["cls"] = cls; d["published"] = published;
             d["failed"] = failed; d["pins"] = pins; d["parts_total"] = total;
             d["parts_started"] = started; d["parts_done"] = done; d["last_use"] = last_use;
             return d;
           })
      .def("stats",
           [](Stream& self) {
             auto& s = self.get();
             auto snap = s.stats().snapshot();
             py::dict d;
             for (auto& [k, v] : snap) {
               if (k == "read_seconds" || k == "stall_seconds")
                 d[py::str(k)] = v;
               else
                 d[py::str(k)] = std::uint64_t(v);
             }
             return d;
           })
      .def("check_invariants", [](Stream& self) { return StreamTesting::check_invariants(self.get()); });

  py::class_<Window, WindowHolder>(m, "Window")
      .def(py::init([](Stream& stream, const std::string& backend, bool lookahead,
                       bool split_turn, std::uint32_t max_rows, std::uint32_t decode_rows,
                       double device_timeout_s, unsigned threads, bool prompt_pred2,
                       std::uint32_t pred2_max, bool decode_prefetch2, bool prompt_buf_reuse,
                       bool record_routes, std::uint32_t start_layers, const std::string& moce,
                       float moce_strength, std::uint32_t moce_keep_top, bool profile_prefetch,
                       bool prefetch_backoff) {
             if (max_rows == 0 || max_rows > (1u << 20))
               throw EngineError(ErrorKind::Config, "max_rows must be 1.." +
                                                        std::to_string(1u << 20) + ", got " +
                                                        std::to_string(max_rows));
             require_finite_positive(device_timeout_s, "device_timeout_s");
             if (threads > 1024)
               throw EngineError(ErrorKind::Config, "threads must be 0..1024 (0 = one per core), "
                                                    "got " + std::to_string(threads));
             if (!std::isfinite(moce_strength) || moce_strength < 0)
               throw EngineError(ErrorKind::Config, "moce_strength must be finite and >= 0");
             WindowOptions o;
             o.lookahead = lookahead;
             o.split_turn = split_turn;
             o.max_rows = max_rows;
             o.decode_rows = decode_rows;
             o.device_timeout_s = device_timeout_s;
             o.two_layer_prompt = prompt_pred2;
             o.two_layer_max = pred2_max;
             o.two_layer_decode = decode_prefetch2;
             o.prompt_buf_reuse = prompt_buf_reuse;
             o.record_routes = record_routes;
             o.start_layers = start_layers;
             if (moce == "off")
               o.moce.mode = MoceMode::Off;
             else if (moce == "scale")
               o.moce.mode = MoceMode::Scale;
             else if (moce == "prune")
               o.moce.mode = MoceMode::Prune;
             else
               throw EngineError(ErrorKind::Config, "moce must be off, scale or prune, got '" +
                                                        moce + "'");
             o.moce.strength = moce_strength;
             o.moce.keep_top = moce_keep_top;
             o.profile_prefetch = profile_prefetch;
             o.prefetch_backoff = prefetch_backoff;
             ExpertStream& es = stream.get();
             py::gil_scoped_release nogil;
             return WindowHolder(
                 new Window(es,
                            strata::make_backend(backend, strata::BackendOptions{threads, {}},
                                                 {strata::route_capability(es.layout(), o.moce)}),
                            o));
           }),
           py::keep_alive<1, 2>(), py::arg("stream"), py::kw_only(), py::arg("backend") = "cpu",
           py::arg("lookahead") = true, py::arg("split_turn") = false,
           py::arg("max_rows") = 1024, py::arg("decode_rows") = 4,
           py::arg("device_timeout_s") = 600.0, py::arg("threads") = 0,
           py::arg("prompt_pred2") = false, py::arg("pred2_max") = 64,
           py::arg("decode_prefetch2") = false, py::arg("prompt_buf_reuse") = false,
           py::arg("record_routes") = false, py::arg("start_layers") = 1,
           py::arg("moce") = "off", py::arg("moce_strength") = 1.0f,
           py::arg("moce_keep_top") = 2, py::arg("profile_prefetch") = true,
           py::arg("prefetch_backoff") = true)
      .def("moe",
           [](Window& w, std::uint32_t layer, const py::array& x) {
             const PackLayout& L = w.layout();
             if (x.ndim() != 2)
               throw py::value_error("x must be 2-D [rows, " + std::to_string(L.hidden) +
                                     "], got " + std::to_string(x.ndim()) + " dimensions");
             if (!x.dtype().is(py::dtype::of<float>()))
               throw py::type_error("x must be float32, got " + dtype_name(x));
             if (x.shape(1) != py::ssize_t(L.hidden))
               throw py::value_error("x must have shape [rows, " + std::to_string(L.hidden) +
                                     "], got [" + std::to_string(x.shape(0)) + ", " +
                                     std::to_string(x.shape(1)) + "]");
             if (!(x.flags() & py::array::c_style))
               throw py::value_error("x must be C-contiguous");
             if (x.shape(0) > py::ssize_t(UINT32_MAX))
               throw py::value_error("x has too many rows");
             const std::uint32_t rows = std::uint32_t(x.shape(0));
             py::array_t<float> out({py::ssize_t(rows), py::ssize_t(L.hidden)});
             const float* src = static_cast<const float*>(x.data());
             float* dst = out.mutable_data();
             {
               py::gil_scoped_release nogil;
               w.moe(layer, src, rows, dst, check_signals);
             }
             return out;
           },
           py::arg("layer"), py::arg("x"))
      .def("close",
           [](Window& w) {
             py::gil_scoped_release nogil;
             w.close();
           })
      .def_property_readonly("closed", &Window::closed)
      .def("begin_turn",
           [](Window& w) {
             py::gil_scoped_release nogil;
             w.begin_turn();
           })
      .def("end_turn",
           [](Window& w) {
             py::gil_scoped_release nogil;
             w.end_turn();
           })
      .def_property_readonly("in_turn", &Window::in_turn)
      .def_property_readonly("next_layer", &Window::next_layer)
      .def_property_readonly("backend", &Window::backend_name)
      .def(
          "arithmetic_unsupported",
          [](const Window& w, const std::string& x_dtype) {
            // Why moe_routed(arithmetic="mlx") cannot run for inputs of x_dtype; "" when it can.
            if (x_dtype != "bfloat16" && x_dtype != "float32")
              throw EngineError(ErrorKind::Config,
                                "x_dtype must be 'bfloat16' or 'float32', got '" + x_dtype + "'");
            return w.arithmetic_unsupported(x_dtype == "bfloat16" ? Arithmetic::MlxBfloat16
                                                                  : Arithmetic::MlxFloat32);
          },
          py::arg("x_dtype"))
      .def(
          "wants_predictions",
          [](const Window& w, std::uint32_t layer, std::uint32_t rows) {
            // (router l+1, router l+2): which predictions a routed call of `rows` rows uses.
            const Lookahead l = w.wants_predictions(layer, rows);
            return py::make_tuple(l.next, l.two_layer);
          },
          py::arg("layer"), py::arg("rows"))
      .def_property_readonly("scratch_bytes", &Window::scratch_bytes)
      .def("reset_stats", &Window::reset_stats)
      .def_property_readonly("settles", &Window::settles)
      .def_property_readonly("route_layer", &Window::route_layer)
      .def("route_resident",
           [](Window& w) {
             const std::vector<std::uint8_t> r = w.route_resident();
             py::array_t<bool> a(py::ssize_t(r.size()));
             std::copy(r.begin(), r.end(), a.mutable_data());
             return a;
           })
      .def("prefetch_stats",
           [](Window& w) {
             const PrefetchGovernor g = w.governor();
             const bool on = w.options().prefetch_backoff;
             py::dict d;
             d["backoff"] = on;
             d["state"] = on ? to_string(g.state()) : "disabled";
             d["cap"] = !on || g.cap() == PrefetchGovernor::kUnlimited ? py::object(py::none())
                                                                      : py::int_(g.cap());
             d["peak"] = g.peak();
             d["epochs"] = g.epochs();
             d["cuts"] = g.cuts();
             d["raises"] = g.raises();
             d["probes"] = g.probes();
             d["last_precision"] = g.last_precision() < 0 ? py::object(py::none())
                                                          : py::float_(g.last_precision());
             d["last_busy"] =
                 g.last_busy() < 0 ? py::object(py::none()) : py::float_(g.last_busy());
             d["trials"] = g.trials();
             d["abandoned_trials"] = g.abandoned_trials();
             d["deterministic"] = g.options().deterministic;  // timing-free (settled moce)
             // Mean wall time of a decode layer call with and without speculation, last trial.
             d["last_wall_on_s"] = g.last_wall_on() < 0 ? py::object(py::none())
                                                        : py::float_(g.last_wall_on() * 1e-9);
             d["last_wall_off_s"] = g.last_wall_off() < 0 ? py::object(py::none())
                                                          : py::float_(g.last_wall_off() * 1e-9);
             return d;
           })
      .def("profile",
           [](Window& w) {
             const std::vector<std::uint32_t> p = w.profile();
             py::array_t<std::uint32_t> a(py::ssize_t(p.size()));
             std::copy(p.begin(), p.end(), a.mutable_data());
             return a;
           })
      .def("set_profile",
           [](Window& w, const py::array& a) {
             const PackLayout& L = w.layout();
             const py::ssize_t want = py::ssize_t(L.n_layers) * L.n_experts;
             const bool shaped = (a.ndim() == 1 && a.shape(0) == want) ||
                                 (a.ndim() == 2 && a.shape(0) == py::ssize_t(L.n_layers) &&
                                  a.shape(1) == py::ssize_t(L.n_experts));
             if (!shaped)
               throw py::value_error("profile must have n_layers * n_experts = " +
                                     std::to_string(want) + " counts ([" +
                                     std::to_string(L.n_layers) + ", " +
                                     std::to_string(L.n_experts) + "] or flat)");
             const char kind = a.dtype().kind();
             if (kind != 'i' && kind != 'u')
               throw py::type_error("profile counts must be integers, got " + dtype_name(a));
             auto wide = py::array_t<std::int64_t, py::array::c_style | py::array::forcecast>::ensure(a);
             if (!wide) throw py::type_error("profile counts must fit in int64");
             std::vector<std::uint32_t> counts(std::size_t(wide.size()));
             const std::int64_t* v = wide.data();
             for (std::size_t i = 0; i < counts.size(); ++i) {
               if (v[i] < 0 || v[i] > std::int64_t(UINT32_MAX))
                 throw py::value_error("profile count " + std::to_string(v[i]) +
                                       " out of range [0, 2^32)");
               counts[i] = std::uint32_t(v[i]);
             }
             py::gil_scoped_release nogil;  // waits for no call, but takes the Window's locks
             w.set_profile(counts);
           },
           py::arg("counts"))
      .def("take_routes",
           [](Window& w) {
             std::vector<std::int32_t> r = w.take_routes();
             py::array_t<std::int32_t> a({py::ssize_t(r.size() / 3), py::ssize_t(3)});
             std::copy(r.begin(), r.end(), a.mutable_data());
             return a;
           })
      .def("layer_stats", [](Window& w) {
        py::list out;
        const std::vector<LayerStats> all = w.layer_stats();
        for (const LayerStats& s : all) {
          py::dict d;
          d["calls"] = s.calls;
          d["tokens"] = s.tokens;
          d["hits"] = s.hits;
          d["misses"] = s.misses;
          d["bytes_read"] = s.bytes_read;
          d["stall_seconds"] = double(s.stall_ns) * 1e-9;
          d["handshake_seconds"] = double(s.handshake_ns) * 1e-9;
          d["handshake_cpu_seconds"] = double(s.handshake_cpu_ns) * 1e-9;
          d["waves"] = s.waves;
          d["pred_correct"] = s.pred_correct;
          d["pred_predicted"] = s.pred_predicted;
          d["pred_actual"] = s.pred_actual;
          d["moce_moved_mass"] = s.moce_moved;
          d["moce_changed"] = s.moce_changed;
          d["settle_seconds"] = double(s.settle_ns) * 1e-9;
          out.append(d);
        }
        return out;
      });

  // ---- externally routed calls (the model's own gate routes; mlx-lm integration) ----
  auto stream_cls = py::reinterpret_borrow<py::class_<Stream>>(m.attr("Stream"));
  stream_cls.def_property_readonly("arena", [](py::object obj) {
    // Read-only bytes of every slot, [n_slots * slot_bytes]; slot s at s * slot_bytes. The
    // MLX-kernel path views experts in place through it (kept alive by this Stream).
    Stream& self = obj.cast<Stream&>();
    const Arena& a = self.get().arena();
    py::array_t<std::uint8_t> arr({py::ssize_t(a.bytes())}, {1}, a.data(), obj);
    py::detail::array_proxy(arr.ptr())->flags &= ~py::detail::npy_api::NPY_ARRAY_WRITEABLE_;
    return arr;
  });
  stream_cls.def_property_readonly("slot_bytes_stride",
                                   [](Stream& self) { return self.get().arena().slot_bytes(); });

  using FloatArray = py::array_t<float, py::array::c_style | py::array::forcecast>;
  auto window_cls = py::reinterpret_borrow<py::class_<Window>>(m.attr("Window"));
  using IntArray = py::array_t<std::int32_t, py::array::c_style | py::array::forcecast>;
  // Validates one [rows, top_k] id table and copies it under the GIL (empty for None): the
  // engine reads the copy without the GIL, so another thread writing the caller's array cannot
  // change an id after the engine checked it.
  auto id_table = [](const std::optional<IntArray>& a, const char* name, std::uint32_t rows,
                     std::uint32_t k, bool required) -> std::vector<std::int32_t> {
    if (!a) {
      if (required) throw std::invalid_argument(std::string(name) + " is required");
      return {};
    }
    if (a->ndim() != 2 || std::uint32_t(a->shape(0)) != rows || std::uint32_t(a->shape(1)) != k)
      throw std::invalid_argument(std::string(name) + " must have shape [" +
                                  std::to_string(rows) + ", " + std::to_string(k) + "]");
    return std::vector<std::int32_t>(a->data(), a->data() + std::size_t(rows) * k);
  };
  auto or_null = [](const std::vector<std::int32_t>& v) { return v.empty() ? nullptr : v.data(); };
  window_cls.def(
      "moe_routed",
      [id_table, or_null](Window& w, std::uint32_t layer, py::buffer x, const std::string& dtype,
                 IntArray ids, FloatArray weights, std::optional<IntArray> pred1,
                 std::optional<IntArray> pred2, const std::string& arithmetic,
                 const std::string& weights_dtype) {
        const PackLayout& L = w.layout();
        py::buffer_info xb = x.request();
        Window::XType xt;
        std::size_t item;
        if (dtype == "float32") {
          xt = Window::XType::F32, item = 4;
        } else if (dtype == "float16") {
          xt = Window::XType::F16, item = 2;
        } else if (dtype == "bfloat16") {
          xt = Window::XType::BF16, item = 2;
        } else {
          throw std::invalid_argument("x dtype must be float32, float16 or bfloat16, got " +
                                      dtype);
        }
        if (xb.ndim != 2 || std::uint32_t(xb.shape[1]) != L.hidden)
          throw std::invalid_argument("x must have shape [T, " + std::to_string(L.hidden) + "]");
        if (std::size_t(xb.itemsize) != item)
          throw std::invalid_argument("x itemsize " + std::to_string(xb.itemsize) +
                                      " does not match dtype " + dtype);
        if (xb.strides[1] != py::ssize_t(item) ||
            xb.strides[0] != py::ssize_t(item) * py::ssize_t(L.hidden))
          throw std::invalid_argument("x must be C-contiguous");
        const std::uint32_t rows = std::uint32_t(xb.shape[0]), k = L.top_k;
        const auto ids_v = id_table(ids, "ids", rows, k, true);
        if (weights.ndim() != 2 || std::uint32_t(weights.shape(0)) != rows ||
            std::uint32_t(weights.shape(1)) != k)
          throw std::invalid_argument("weights must have shape [" + std::to_string(rows) + ", " +
                                      std::to_string(k) + "]");
        const std::vector<float> weights_v(weights.data(),
                                           weights.data() + std::size_t(rows) * k);
        const auto pred1_v = id_table(pred1, "pred1", rows, k, false);
        const auto pred2_v = id_table(pred2, "pred2", rows, k, false);
        Window::Routed r;
        // "mlx": MLX's own arithmetic for x's dtype (bfloat16 or float32). The one place these
        // arguments are checked (Window.moe_routed forwards them).
        if (arithmetic != "float32" && arithmetic != "mlx")
          throw EngineError(ErrorKind::Config,
                            "arithmetic must be 'float32' or 'mlx', got '" + arithmetic + "'");
        if (weights_dtype != "float32" && weights_dtype != "bfloat16")
          throw EngineError(ErrorKind::Config,
                            "weights_dtype must be 'float32' or 'bfloat16', got '" +
                                weights_dtype + "'");
        if (arithmetic == "mlx") {
          if (xt == Window::XType::F16)
            throw EngineError(ErrorKind::Config,
                              "arithmetic='mlx' reproduces MLX for bfloat16 and float32 inputs, "
                              "not float16");
          r.rounding.arithmetic =
              xt == Window::XType::BF16 ? Arithmetic::MlxBfloat16 : Arithmetic::MlxFloat32;
          r.rounding.weights_bf16 = weights_dtype == "bfloat16";
        }
        r.ids = ids_v.data();
        r.weights = weights_v.data();
        r.pred1 = or_null(pred1_v);
        r.pred2 = or_null(pred2_v);
        py::array_t<float> out({py::ssize_t(rows), py::ssize_t(L.hidden)});
        float* dst = out.mutable_data();
        {
          py::gil_scoped_release nogil;
          w.moe_routed(layer, xb.ptr, xt, rows, r, dst, check_signals);
        }
        return out;
      },
      py::arg("layer"), py::arg("x"), py::arg("dtype"), py::arg("ids"), py::arg("weights"),
      py::arg("pred1") = py::none(), py::arg("pred2") = py::none(),
      py::arg("arithmetic") = "float32", py::arg("weights_dtype") = "float32");
  window_cls.def(
      "moe_routed_external",
      [id_table, or_null](Window& w, std::uint32_t layer, IntArray ids, std::optional<IntArray> pred1,
                 std::optional<IntArray> pred2, py::function compute) {
        const PackLayout& L = w.layout();
        if (ids.ndim() != 2) throw std::invalid_argument("ids must be 2-D [rows, top_k]");
        const std::uint32_t rows = std::uint32_t(ids.shape(0)), k = L.top_k;
        const auto ids_v = id_table(ids, "ids", rows, k, true);
        const auto pred1_v = id_table(pred1, "pred1", rows, k, false);
        const auto pred2_v = id_table(pred2, "pred2", rows, k, false);
        Window::Routed r;
        r.ids = ids_v.data();
        r.pred1 = or_null(pred1_v);
        r.pred2 = or_null(pred2_v);
        Window::WaveCompute fn = [&compute, k](std::uint32_t row0, std::uint32_t n,
                                               const std::uint32_t* slots) {
          py::gil_scoped_acquire gil;
          py::array_t<std::uint32_t> s({py::ssize_t(n), py::ssize_t(k)});
          std::copy(slots, slots + std::size_t(n) * k, s.mutable_data());
          compute(row0, n, s);
        };
        py::gil_scoped_release nogil;
        w.moe_routed_external(layer, rows, r, fn, check_signals);
      },
      py::arg("layer"), py::arg("ids"), py::arg("pred1"), py::arg("pred2"), py::arg("compute"));

  m.def(
      "bench_kernels",
      [](Stream& stream, std::uint32_t layer, std::uint32_t rows, std::uint32_t repeats,
         unsigned threads, std::uint32_t seed) {
        ExpertStream& s = stream.get();
        if (layer >= s.layout().n_layers)
          throw py::index_error("layer " + std::to_string(layer) + " out of range [0, " +
                                std::to_string(s.layout().n_layers) + ")");
        if (rows == 0 || rows > (1u << 16)) throw py::value_error("rows must be 1..65536");
        if (repeats == 0 || repeats > 100000) throw py::value_error("repeats must be 1..100000");
        if (threads > 1024) throw py::value_error("threads must be 0..1024");
        std::vector<KernelTiming> t;
        {
          py::gil_scoped_release nogil;
          auto backend = make_cpu_backend(threads);
          t = bench_kernels(s, *backend, layer, rows, repeats, seed);
        }
        py::list out;
        for (const auto& k : t) {
          py::dict d;
          d["op"] = k.op;
          d["seconds"] = k.seconds;
          d["flops"] = k.flops;
          d["weight_bytes"] = k.weight_bytes;
          out.append(d);
        }
        return out;
      },
      py::arg("stream"), py::arg("layer"), py::arg("rows"), py::arg("repeats") = 5,
      py::arg("threads") = 0, py::arg("seed") = 0);

  // ---- CRC32C (pack format v2 record checksums): one implementation for C++ and Python ----
  m.def(
      "crc32c",
      [](py::object buffer, std::uint32_t seed) {
        Py_buffer view;
        // PyBUF_SIMPLE: a contiguous run of bytes, or BufferError naming the problem.
        if (PyObject_GetBuffer(buffer.ptr(), &view, PyBUF_SIMPLE) != 0) throw py::error_already_set();
        std::unique_ptr<Py_buffer, void (*)(Py_buffer*)> hold(&view, PyBuffer_Release);
        const std::size_t n = std::size_t(view.len);
        if (n < (std::size_t(64) << 10)) return crc32c(view.buf, n, seed);
        // Large records: let other threads (the pack writer's producer, verify's pool) run.
        py::gil_scoped_release nogil;
        return crc32c(view.buf, n, seed);
      },
      py::arg("buffer"), py::arg("seed") = 0,
      "CRC32C (Castagnoli) of a contiguous buffer, continuing from `seed` like zlib.crc32: "
      "crc32c(b, crc32c(a)) == crc32c(a + b). Releases the GIL for buffers of 64 KiB or more.");
  m.attr("CRC32C_IMPL") = std::string(crc32c_impl());

  // ---- benchmarks/io_bandwidth.py --page-cache: the fair raw reference, GIL released ----
  m.def(
      "bench_raw_read",
      [](const std::string& path, std::uint64_t first, std::uint64_t count,
         std::uint64_t part_bytes, unsigned threads, std::uint64_t dest_bytes, bool direct) {
        RawReadResult r;
        {
          py::gil_scoped_release nogil;
          r = raw_read_records(path, first, count, part_bytes, threads, dest_bytes, direct);
        }
        py::dict d;
        d["seconds"] = r.seconds;
        d["bytes"] = r.bytes;
        return d;
      },
      py::arg("path"), py::arg("first"), py::arg("count"), py::arg("part_bytes"),
      py::arg("threads"), py::arg("dest_bytes"), py::arg("direct") = false);
}
