// _core.Stream: ExpertStream, the arena and its slots (docs/architecture.md section 4), with
// ReadClass, SlotState and ABSENT from residency/slot.h. The test hooks (manual IO, faults,
// the invariant scan, eviction by hand) are bound in testing.cpp, not here.
#include "stream.h"

#include <pybind11/native_enum.h>
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <cmath>

#include "arguments.h"
#include "pack.h"
#include "residency/stream_testing.h"

namespace strata::python {

namespace {

void require_finite_positive(double v, const char* what) {
  if (!(v > 0) || !std::isfinite(v))
    throw EngineError(ErrorKind::Config,
                      std::string(what) + " must be positive and finite, got " + std::to_string(v));
}

Stream open_stream(const std::string& path, std::uint64_t arena_bytes, const py::handle& io_threads,
                   std::uint64_t part_bytes, bool direct_io, bool verify_reads, double io_timeout_s,
                   bool publish_prefetch, bool simulate_io, const std::string& eviction,
                   std::uint32_t io_spin_us) {
  if (arena_bytes == 0) throw EngineError(ErrorKind::Config, "arena_bytes must be positive");
  require_finite_positive(io_timeout_s, "io_timeout_s");
  StreamOptions o;
  o.arena_bytes = arena_bytes;
  o.io_threads = count_arg(io_threads, 256, "io_threads");
  o.part_bytes = part_bytes;
  if (io_spin_us > 100000)
    throw EngineError(ErrorKind::Config, "io_spin_us must be 0..100000, got " +
                                             std::to_string(io_spin_us));
  o.io_spin_us = io_spin_us;
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
}

// Closes the Windows on the stream first (each waits for its layer in flight), then stops the
// IO threads, waiting at most io_timeout_s for a read in flight: a stuck one is left to finish
// on its own (the arena stays alive for it) with a RuntimeWarning naming it.
void close_stream(Stream& self) {
  if (!self.s) return;
  ExpertStream& s = *self.s;
  bool joined;
  {
    py::gil_scoped_release nogil;
    joined = s.close(s.options().io_timeout_s);
  }
  if (!joined) {
    const std::string msg =
        "ExpertStream.close(): an IO thread is still inside a read after io_timeout_s = " +
        std::to_string(s.options().io_timeout_s) + " s (" + s.describe_in_flight() +
        "); the stream is closed and its memory is kept until the read returns";
    if (PyErr_WarnEx(PyExc_RuntimeWarning, msg.c_str(), 1) != 0) throw py::error_already_set();
  }
}

py::dict slot_table(ExpertStream& s) {
  auto v = s.slots();
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
  d["key"] = key;
  d["state"] = state;
  d["cls"] = cls;
  d["published"] = published;
  d["failed"] = failed;
  d["pins"] = pins;
  d["parts_total"] = total;
  d["parts_started"] = started;
  d["parts_done"] = done;
  d["last_use"] = last_use;
  return d;
}

py::dict stream_stats(ExpertStream& s) {
  py::dict d;
  for (auto& [k, v] : s.stats().snapshot()) {
    if (k.size() > 8 && k.compare(k.size() - 8, 8, "_seconds") == 0)
      d[py::str(k)] = v;
    else
      d[py::str(k)] = std::uint64_t(v);
  }
  return d;
}

void bind_enums(py::module_& m) {
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
}

}  // namespace

void init_stream(py::module_& m) {
  bind_enums(m);
  m.def("disposing", &ExpertStream::disposing,
        "Closed streams a background thread still waits to free (a read was stuck).");

  py::class_<Stream>(m, "Stream")
      .def(py::init(&open_stream), py::arg("path"), py::kw_only(), py::arg("arena_bytes"),
           py::arg("io_threads"), py::arg("part_bytes"), py::arg("direct_io"),
           py::arg("verify_reads"), py::arg("io_timeout_s"), py::arg("publish_prefetch"),
           py::arg("simulate_io") = false, py::arg("eviction") = "decayed_lfu",
           py::arg("io_spin_us") = 0)
      .def("close", &close_stream)
      .def_property_readonly("closed", [](Stream& self) { return !self.s || self.s->closed(); })
      .def_property_readonly("n_clients", [](Stream& self) { return self.get().n_clients(); })
      .def_property_readonly("clients_waiting_for_space",
                             [](Stream& self) { return self.get().clients_waiting_for_space(); })
      .def_property_readonly("n_slots", [](Stream& self) { return self.get().n_slots(); })
      .def_property_readonly("n_parts", [](Stream& self) { return self.get().n_parts(); })
      .def_property_readonly("part_bytes", [](Stream& self) { return self.get().part_bytes(); })
      .def_property_readonly("layout", [](Stream& self) { return layout_dict(self.get().layout()); })
      .def_property_readonly("direct_io", [](Stream& self) { return self.get().file().direct(); })
      .def_property_readonly("direct_note",
                             [](Stream& self) { return self.get().file().direct_note(); })
      // ---- requests, waits, the handshake's publication ----
      .def(
          "request",
          [](Stream& self, std::uint32_t layer, const py::object& experts, ReadClass cls) {
            auto& s = self.get();
            const auto ids = ids_arg(experts, "request", s.layout().n_experts);
            RequestResult r;
            {
              py::gil_scoped_release nogil;
              r = s.request(layer, ids.data(), ids.size(), cls, check_signals);
            }
            return py::make_tuple(r.hits, r.misses, r.dropped);
          },
          py::arg("layer"), py::arg("experts"), py::arg("cls"))
      .def(
          "wait",
          [](Stream& self, std::uint32_t layer, const py::object& experts) {
            auto& s = self.get();
            const auto ids = ids_arg(experts, "wait", s.layout().n_experts);
            py::gil_scoped_release nogil;
            s.wait(layer, ids.data(), ids.size(), check_signals);
          },
          py::arg("layer"), py::arg("experts"))
      .def(
          "publish",
          [](Stream& self, std::uint32_t layer) {
            auto& s = self.get();
            py::gil_scoped_release nogil;
            return s.publish(layer);
          },
          py::arg("layer"))
      // ---- protections and plans ----
      .def(
          "enter_layer",
          [](Stream& self, std::uint32_t layer, const py::object& experts) {
            auto& s = self.get();
            if (experts.is_none()) {
              s.enter_layer(layer);
              return;
            }
            // A list, even an empty one, protects exactly its experts. The engine skips ids
            // beyond the layer here (it protects, it reads nothing), so this call refuses them.
            const std::uint32_t E = s.layout().n_experts;
            const auto ids = ids_arg(experts, "enter_layer", E);
            for (std::int32_t e : ids)
              if (e < 0 || std::uint32_t(e) >= E)
                throw py::index_error("enter_layer: expert " + std::to_string(e) +
                                      " out of range [0, " + std::to_string(E) + ")");
            s.enter_layer(layer, ids.data(), ids.size());
          },
          py::arg("layer"), py::arg("experts") = py::none())
      .def("after_layer", [](Stream& self, std::uint32_t l) { self.get().after_layer(l); },
           py::arg("layer"))
      .def("end_turn", [](Stream& self) { self.get().end_turn(); })
      .def(
          "plan",
          [](Stream& self, std::uint32_t layer, const py::object& experts) {
            auto& s = self.get();
            const auto ids = ids_arg(experts, "plan", s.layout().n_experts);
            py::array_t<std::uint8_t> out(py::ssize_t(ids.size()));
            s.plan(layer, ids.data(), ids.size(), out.mutable_data());
            return out;
          },
          py::arg("layer"), py::arg("experts"))
      .def("release_plan", [](Stream& self) { self.get().release_plan(); })
      // ---- lifecycle primitives ----
      .def(
          "cancel",
          [](Stream& self, const py::object& layer, const py::object& expert) {
            auto& s = self.get();
            const PackLayout& L = s.layout();
            return s.cancel(index_arg(layer, L.n_layers, "layer"),
                            index_arg(expert, L.n_experts, "expert"));
          },
          py::arg("layer"), py::arg("expert"))
      .def(
          "retire_unused_pre",
          [](Stream& self, std::uint32_t layer, const py::object& chosen) {
            auto& s = self.get();
            const auto ids = ids_arg(chosen, "chosen", s.layout().n_experts);
            return s.retire_unused_pre(layer, ids.data(), ids.size());
          },
          py::arg("layer"), py::arg("chosen"))
      .def("release_limbo", [](Stream& self) { return self.get().release_limbo(); })
      .def("victim", [](Stream& self, bool spec) { return StreamTesting::victim(self.get(), spec); },
           py::arg("speculative") = false)
      // ---- views ----
      .def_property_readonly("smap",
                             [](py::object obj) {
                               auto& s = obj.cast<Stream&>().get();
                               return read_only_view(
                                   s.smap(), py::ssize_t(s.layout().n_keys()), obj);
                             })
      // Read-only bytes of every slot, [n_slots * slot_bytes_stride]; slot s at
      // s * slot_bytes_stride. The MLX-kernel path views experts in place through it (kept
      // alive by this Stream).
      .def_property_readonly("arena",
                             [](py::object obj) {
                               const Arena& a = obj.cast<Stream&>().get().arena();
                               return read_only_view(a.data(), py::ssize_t(a.bytes()), obj);
                             })
      .def_property_readonly("slot_bytes_stride",
                             [](Stream& self) { return self.get().arena().slot_bytes(); })
      .def("key", [](Stream& self, std::int64_t layer,
                     std::int64_t expert) { return self.get().key(layer, expert); },
           py::arg("layer"), py::arg("expert"))
      .def("where", [](Stream& self, std::int64_t layer,
                       std::int64_t expert) { return self.get().where(layer, expert); },
           py::arg("layer"), py::arg("expert"))
      .def(
          "slot_bytes",
          [](py::object obj, const py::object& slot) {
            auto& s = obj.cast<Stream&>().get();
            const std::uint32_t i = index_arg(slot, s.n_slots(), "slot");
            return read_only_view(s.arena().slot(i), py::ssize_t(s.layout().record_bytes), obj);
          },
          py::arg("slot"))
      .def("slots", [](Stream& self) { return slot_table(self.get()); })
      .def("stats", [](Stream& self) { return stream_stats(self.get()); });
}

}  // namespace strata::python
