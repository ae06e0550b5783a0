// _core.Stream: ExpertStream, the arena and its slots (docs/architecture.md section 4), with
// ReadClass, SlotState and ABSENT from residency/slot.h: opening, closing, geometry, views and
// stats. _core.StreamOptions: the stream's settings, converted field by field and checked by
// the engine's one validate() (exec/window_options.h) before a stream opens. The handshake's steps (request, wait, publish, protections, plans, limbo, victim) are
// the Window's to take in order; calling them beside a running Window corrupts its state, so
// they are bound in testing.cpp with the other test hooks, not here.
#include "stream.h"

#include <pybind11/native_enum.h>
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <cmath>
#include <vector>

#include "arguments.h"
#include "exec/window_options.h"
#include "pack.h"

namespace strata::python {

namespace {

Stream open_stream(const std::string& path, const StreamOptions& options) {
  validate(options);
  py::gil_scoped_release nogil;
  return Stream{std::make_unique<ExpertStream>(path, options)};
}

// A field of StreamOptions, read as it is and set through `convert` (arguments.h).
template <class T, T StreamOptions::*Field, class Convert>
void option_field(py::class_<StreamOptions>& c, const char* name, Convert convert) {
  c.def_property(
      name, [](const StreamOptions& o) { return o.*Field; },
      [name, convert](StreamOptions& o, const py::object& v) { o.*Field = convert(v, name); });
}

void bind_options(py::module_& m) {
  py::class_<StreamOptions> c(m, "StreamOptions",
                              "A stream's settings (residency/expert_stream.h StreamOptions); "
                              "StreamConfig fills it (docs/settings.md).");
  c.def(py::init<>());
  const auto boolean = [](const py::object& v, const char* n) { return option_bool(v, n); };
  const auto u32 = [](const py::object& v, const char* n) {
    return std::uint32_t(option_uint(v, UINT32_MAX, n));
  };
  const auto u64 = [](const py::object& v, const char* n) {
    return option_uint(v, UINT64_MAX, n);
  };
  const auto seconds = [](const py::object& v, const char* n) { return option_float(v, n); };
  option_field<std::uint64_t, &StreamOptions::arena_bytes>(c, "arena_bytes", u64);
  option_field<std::uint32_t, &StreamOptions::io_threads>(c, "io_threads", u32);
  option_field<std::uint64_t, &StreamOptions::part_bytes>(c, "part_bytes", u64);
  option_field<std::uint32_t, &StreamOptions::io_spin_us>(c, "io_spin_us", u32);
  option_field<bool, &StreamOptions::direct_io>(c, "direct_io", boolean);
  option_field<bool, &StreamOptions::verify_reads>(c, "verify_reads", boolean);
  option_field<double, &StreamOptions::io_timeout_s>(c, "io_timeout_s", seconds);
  option_field<bool, &StreamOptions::publish_prefetch>(c, "publish_prefetch", boolean);
  option_field<bool, &StreamOptions::simulate_io>(c, "simulate_io", boolean);
  c.def_property(
      "eviction", [](const StreamOptions& o) { return std::string(to_string(o.eviction)); },
      [](StreamOptions& o, const py::object& v) {
        const auto name = py::isinstance<py::str>(v) ? v.cast<std::string>() : std::string();
        const auto policy = parse_eviction_policy(name);
        if (!policy)
          throw EngineError(ErrorKind::Config, "eviction must be decayed_lfu or lru, got " +
                                                   std::string(py::repr(v)));
        o.eviction = *policy;
      });
  c.def("validate", [](const StreamOptions& o) { validate(o); },
        "ConfigError naming the first field out of range.");
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

bool fill_arena(Stream& self) {
  ExpertStream& s = self.get();
  const PackLayout& L = s.layout();
  if (std::uint64_t(s.n_slots()) < L.n_keys()) return false;
  std::vector<std::int32_t> every(L.n_experts);
  for (std::uint32_t e = 0; e < L.n_experts; ++e) every[e] = std::int32_t(e);
  py::gil_scoped_release nogil;
  // Every layer's reads are queued before any is waited for, so the IO threads read on while
  // the first layer completes.
  for (std::uint32_t l = 0; l < L.n_layers; ++l)
    s.request(l, every.data(), every.size(), ReadClass::Urgent, check_signals);
  for (std::uint32_t l = 0; l < L.n_layers; ++l)
    s.wait(l, every.data(), every.size(), check_signals);
  return true;
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
  bind_options(m);
  m.def("disposing", &ExpertStream::disposing,
        "Closed streams a background thread still waits to free (a read was stuck).");

  py::class_<Stream>(m, "Stream")
      .def(py::init(&open_stream), py::arg("path"), py::arg("options"))
      .def("close", &close_stream)
      .def_property_readonly("closed", [](Stream& self) { return !self.s || self.s->closed(); })
      .def_property_readonly("n_slots", [](Stream& self) { return self.get().n_slots(); })
      .def_property_readonly("layout", [](Stream& self) { return layout_dict(self.get().layout()); })
      .def_property_readonly("direct_io", [](Stream& self) { return self.get().file().direct(); })
      .def_property_readonly("direct_note",
                             [](Stream& self) { return self.get().file().direct_note(); })
      // ---- views ----
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
      // The record bytes of a published expert (a read-only view kept alive by this Stream),
      // or None when smap holds no slot for it.
      .def(
          "expert_bytes",
          [](py::object obj, const py::object& layer, const py::object& expert) -> py::object {
            auto& s = obj.cast<Stream&>().get();
            const PackLayout& L = s.layout();
            const std::uint32_t key = s.key(index_arg(layer, L.n_layers, "layer"),
                                            index_arg(expert, L.n_experts, "expert"));
            const std::uint32_t slot = s.smap_at(key);
            if (slot == kAbsent) return py::none();
            return read_only_view(s.arena().slot(slot), py::ssize_t(L.record_bytes), obj);
          },
          py::arg("layer"), py::arg("expert"))
      .def("fill", &fill_arena,
           "Reads every expert of the pack when the arena has a slot for each (nothing is then "
           "ever evicted); returns whether it did.")
      .def("slots", [](Stream& self) { return slot_table(self.get()); })
      .def("stats", [](Stream& self) { return stream_stats(self.get()); });
}

}  // namespace strata::python
