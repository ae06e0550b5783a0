// strata_stream._core: the pybind11 face of the engine. Thin on purpose: argument conversion,
// GIL release around every wait, and errors mapped onto strata_stream.errors.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <memory>
#include <optional>

#include "common/errors.h"
#include "residency/expert_stream.h"
#include "kernel_bench.h"
#include "raw_read_bench.h"
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

using IntArray = py::array_t<std::int32_t, py::array::c_style | py::array::forcecast>;

struct Stream {
  std::unique_ptr<ExpertStream> s;

  ExpertStream& get() {
    if (!s) throw EngineError(ErrorKind::Closed, "ExpertStream is closed");
    return *s;
  }
};

py::dict layout_dict(const PackLayout& L) {
  py::dict d;
  d["n_layers"] = L.n_layers;
  d["n_experts"] = L.n_experts;
  d["top_k"] = L.top_k;
  d["hidden"] = L.hidden;
  d["moe_intermediate"] = L.moe_intermediate;
  d["routing"] = L.routing == Routing::SoftmaxTopk ? "softmax_topk" : "topk_softmax";
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
        case ErrorKind::Interrupted: name = "StrataError"; break;
      }
      py::object cls = py::module_::import("strata_stream.errors").attr(name);
      PyErr_SetString(cls.ptr(), e.what());
    }
  });

  m.attr("ABSENT") = kAbsent;
  m.def("crc32", [](py::buffer b) {
    py::buffer_info info = b.request();
    return crc32_bytes(info.ptr, std::size_t(info.size * info.itemsize));
  });
  m.def("read_layout", [](const std::string& path) { return layout_dict(read_pack_layout(path)); });

  py::class_<Stream>(m, "Stream")
      .def(py::init([](const std::string& path, std::uint64_t arena_bytes, std::uint32_t io_threads,
                       std::uint64_t part_bytes, bool direct_io, bool verify_reads,
                       double io_timeout_s, bool publish_prefetch, bool simulate_io,
                       const std::string& eviction) {
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
           py::arg("path"), py::arg("arena_bytes"), py::arg("io_threads"), py::arg("part_bytes"),
           py::arg("direct_io"), py::arg("verify_reads"), py::arg("io_timeout_s"),
           py::arg("publish_prefetch"), py::arg("simulate_io") = false,
           py::arg("eviction") = "decayed_lfu")
      .def("close",
           [](Stream& self) {
             if (!self.s) return;
             py::gil_scoped_release nogil;
             self.s->close();
           })
      .def_property_readonly("closed", [](Stream& self) { return !self.s || self.s->closed(); })
      .def_property_readonly("n_slots", [](Stream& self) { return self.get().n_slots(); })
      .def_property_readonly("n_parts", [](Stream& self) { return self.get().n_parts(); })
      .def_property_readonly("layout", [](Stream& self) { return layout_dict(self.get().layout()); })
      .def_property_readonly("direct_io", [](Stream& self) { return self.get().file().direct(); })
      .def_property_readonly("direct_note",
                             [](Stream& self) { return self.get().file().direct_note(); })
      .def("request",
           [](Stream& self, std::uint32_t layer, IntArray experts, int cls) {
             auto& s = self.get();
             if (cls < 0 || cls >= kReadClasses) throw std::invalid_argument("bad read class");
             RequestResult r;
             {
               py::gil_scoped_release nogil;
               r = s.request(layer, experts.data(), std::size_t(experts.size()),
                             static_cast<ReadClass>(cls), check_signals);
             }
             return py::make_tuple(r.hits, r.misses, r.dropped);
           })
      .def("wait",
           [](Stream& self, std::uint32_t layer, IntArray experts) {
             auto& s = self.get();
             py::gil_scoped_release nogil;
             s.wait(layer, experts.data(), std::size_t(experts.size()), check_signals);
           })
      .def("publish",
           [](Stream& self, std::uint32_t layer) {
             auto& s = self.get();
             py::gil_scoped_release nogil;
             return s.publish(layer);
           })
      .def("enter_layer",
           [](Stream& self, std::uint32_t l, std::optional<IntArray> experts) {
             if (experts)
               self.get().enter_layer(l, experts->data(), std::size_t(experts->size()));
             else
               self.get().enter_layer(l);
           },
           py::arg("layer"), py::arg("experts") = py::none())
      .def("after_layer", [](Stream& self, std::uint32_t l) { self.get().after_layer(l); })
      .def("end_turn", [](Stream& self) { self.get().end_turn(); })
      .def("plan",
           [](Stream& self, std::uint32_t layer, IntArray experts) {
             py::array_t<std::uint8_t> out(experts.size());
             self.get().plan(layer, experts.data(), std::size_t(experts.size()),
                             out.mutable_data());
             return out;
           })
      .def("release_plan", [](Stream& self) { self.get().release_plan(); })
      .def("cancel", [](Stream& self, std::uint32_t l, std::uint32_t e) { return self.get().cancel(l, e); })
      .def("retire_unused_pre",
           [](Stream& self, std::uint32_t layer, IntArray chosen) {
             return self.get().retire_unused_pre(layer, chosen.data(), std::size_t(chosen.size()));
           })
      .def("release_limbo", [](Stream& self) { return self.get().release_limbo(); })
      .def("victim", [](Stream& self, bool spec) { return self.get().victim(spec); },
           py::arg("speculative") = false)
      .def("evict_one", [](Stream& self) { return self.get().evict_one(); })
      .def("pending_jobs",
           [](Stream& self) {
             py::list out;
             for (const JobInfo& j : self.get().pending_jobs())
               out.append(py::make_tuple(j.slot, j.key, j.part, int(j.cls)));
             return out;
           })
      .def("run_job",
           [](Stream& self, std::size_t i) {
             auto& s = self.get();
             py::gil_scoped_release nogil;
             return s.run_job(i);
           })
      .def("inject_fault",
           [](Stream& self, std::uint32_t key, int part, int kind, int err, int count,
              int delay_ms) {
             if (kind < 0 || kind > 2) throw std::invalid_argument("bad fault kind");
             Fault f;
             f.kind = static_cast<FaultKind>(kind);
             f.err = err;
             f.delay_ms = delay_ms;
             f.remaining = count;
             self.get().faults().add(key, part, f);
           })
      .def("clear_faults", [](Stream& self) { self.get().faults().clear(); })
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
      .def("where", [](Stream& self, std::uint32_t key) { return self.get().where(key); })
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
      .def("check_invariants", [](Stream& self) { return self.get().check_invariants(); });

  py::class_<Window>(m, "Window")
      .def(py::init([](Stream& stream, const std::string& backend, bool lookahead,
                       bool split_turn, std::uint32_t max_rows, std::uint32_t decode_rows,
                       double device_timeout_s, unsigned threads, bool prompt_pred2,
                       std::uint32_t pred2_max, bool decode_prefetch2, bool prompt_buf_reuse,
                       bool record_routes, std::uint32_t start_layers, const std::string& moce,
                       float moce_strength, std::uint32_t moce_keep_top, bool profile_prefetch,
                       bool prefetch_backoff) {
             if (backend != "cpu")
               throw EngineError(ErrorKind::Config, "backend '" + backend +
                                                        "' is not available here (have: cpu)");
             WindowOptions o;
             o.lookahead = lookahead;
             o.split_turn = split_turn;
             o.max_rows = max_rows;
             o.decode_rows = decode_rows;
             o.device_timeout_s = device_timeout_s;
             o.prompt_pred2 = prompt_pred2;
             o.pred2_max = pred2_max;
             o.decode_prefetch2 = decode_prefetch2;
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
             return std::make_unique<Window>(es, make_cpu_backend(threads), o);
           }),
           py::keep_alive<1, 2>(), py::arg("stream"), py::arg("backend"), py::arg("lookahead"),
           py::arg("split_turn"), py::arg("max_rows"), py::arg("decode_rows"),
           py::arg("device_timeout_s"), py::arg("threads") = 0, py::arg("prompt_pred2") = false,
           py::arg("pred2_max") = 64, py::arg("decode_prefetch2") = false,
           py::arg("prompt_buf_reuse") = false, py::arg("record_routes") = false,
           py::arg("start_layers") = 1, py::arg("moce") = "off",
           py::arg("moce_strength") = 1.0f, py::arg("moce_keep_top") = 2,
           py::arg("profile_prefetch") = true, py::arg("prefetch_backoff") = true)
      .def("moe",
           [](Window& w, std::uint32_t layer,
              py::array_t<float, py::array::c_style> x) {
             const std::uint32_t rows = std::uint32_t(x.shape(0));
             py::array_t<float> out({py::ssize_t(rows), py::ssize_t(x.shape(1))});
             const float* src = x.data();
             float* dst = out.mutable_data();
             {
               py::gil_scoped_release nogil;
               w.moe(layer, src, rows, dst, check_signals);
             }
             return out;
           })
      .def("begin_turn", &Window::begin_turn)
      .def("end_turn",
           [](Window& w) {
             py::gil_scoped_release nogil;
             w.end_turn();
           })
      .def_property_readonly("in_turn", &Window::in_turn)
      .def_property_readonly("next_layer", &Window::next_layer)
      .def_property_readonly("backend", &Window::backend_name)
      .def_property_readonly("scratch_bytes", &Window::scratch_bytes)
      .def("reset_stats", &Window::reset_stats)
      .def_property_readonly("settles", &Window::settles)
      .def_property_readonly("route_layer", &Window::route_layer)
      .def("route_resident",
           [](Window& w) {
             const auto& r = w.route_resident();
             py::array_t<bool> a(py::ssize_t(r.size()));
             std::copy(r.begin(), r.end(), a.mutable_data());
             return a;
           })
      .def("prefetch_stats",
           [](Window& w) {
             const PrefetchGovernor& g = w.governor();
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
             // Mean wall time of a decode layer call with and without speculation, last trial.
             d["last_wall_on_s"] = g.last_wall_on() < 0 ? py::object(py::none())
                                                        : py::float_(g.last_wall_on() * 1e-9);
             d["last_wall_off_s"] = g.last_wall_off() < 0 ? py::object(py::none())
                                                          : py::float_(g.last_wall_off() * 1e-9);
             return d;
           })
      .def("profile",
           [](Window& w) {
             const auto& p = w.profile();
             py::array_t<std::uint32_t> a(py::ssize_t(p.size()));
             std::copy(p.begin(), p.end(), a.mutable_data());
             return a;
           })
      .def("set_profile",
           [](Window& w, py::array_t<std::uint32_t, py::array::c_style | py::array::forcecast> a) {
             w.set_profile(std::vector<std::uint32_t>(a.data(), a.data() + a.size()));
           })
      .def("take_routes",
           [](Window& w) {
             std::vector<std::int32_t> r = w.take_routes();
             py::array_t<std::int32_t> a({py::ssize_t(r.size() / 3), py::ssize_t(3)});
             std::copy(r.begin(), r.end(), a.mutable_data());
             return a;
           })
      .def("layer_stats", [](Window& w) {
        py::list out;
        for (const LayerStats& s : w.layer_stats()) {
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

  m.def(
      "bench_kernels",
      [](Stream& stream, std::uint32_t layer, std::uint32_t rows, std::uint32_t repeats,
         unsigned threads, std::uint32_t seed) {
        ExpertStream& s = stream.get();
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
