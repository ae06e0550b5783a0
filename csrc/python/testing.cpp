// _core.testing: the hooks tests drive the engine with, off the product's Stream class. The
// handshake's steps one at a time (request, wait, publish, protections, plans, limbo, victim:
// what a Window does in order, and what corrupts a Window's state when called beside it),
// the stream's maps and part split, manual IO (a stream made with io_threads=0 performs a part
// read only when told), injected read faults, eviction by hand and the engine's own invariant
// scan. strata_stream.testing is the Python face; every function takes the _core.Stream it acts
// on.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cmath>

#include "arguments.h"
#include "common/errors.h"
#include "residency/fault_injection.h"
#include "residency/stream_testing.h"
#include "stream.h"

namespace strata::python {

namespace {

FaultKind fault_kind(const std::string& name) {
  if (name == "eio") return FaultKind::Errno;
  if (name == "short") return FaultKind::ShortRead;
  if (name == "delay") return FaultKind::Delay;
  throw py::value_error("fault kind must be one of delay, eio, short, got '" + name + "'");
}

void inject_fault(Stream& stream, const py::object& layer, const py::object& expert, int part,
                  const std::string& kind, int count, int errno_value, double delay_s) {
  ExpertStream& s = stream.get();
  const PackLayout& L = s.layout();
  const std::uint32_t l = index_arg(layer, L.n_layers, "layer");
  const std::uint32_t e = index_arg(expert, L.n_experts, "expert");
  if (part < -1 || part >= int(s.n_parts()))
    throw py::index_error("inject_fault: part " + std::to_string(part) + " out of range [-1, " +
                          std::to_string(s.n_parts()) + ")");
  Fault f;
  f.kind = fault_kind(kind);
  if (count < -1) throw py::value_error("inject_fault: count must be >= -1 (-1 = always)");
  if (!(delay_s >= 0) || !std::isfinite(delay_s) || delay_s > 3600)
    throw py::value_error("inject_fault: delay_s must be 0..3600, got " + std::to_string(delay_s));
  f.err = errno_value;
  f.delay_ms = int(delay_s * 1000);
  f.remaining = count;
  StreamTesting::faults(s).add(s.key(l, e), part, f);
}

// The handshake's steps, each as the engine's ExpertStream takes it for its own client (the
// stream's, kStreamClient), with the GIL released around every wait.
void bind_handshake(py::module_& m) {
  m.def(
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
      py::arg("stream"), py::arg("layer"), py::arg("experts"), py::arg("cls"));
  m.def(
      "wait",
      [](Stream& self, std::uint32_t layer, const py::object& experts) {
        auto& s = self.get();
        const auto ids = ids_arg(experts, "wait", s.layout().n_experts);
        py::gil_scoped_release nogil;
        s.wait(layer, ids.data(), ids.size(), check_signals);
      },
      py::arg("stream"), py::arg("layer"), py::arg("experts"));
  m.def(
      "publish",
      [](Stream& self, std::uint32_t layer) {
        auto& s = self.get();
        py::gil_scoped_release nogil;
        return s.publish(layer);
      },
      py::arg("stream"), py::arg("layer"));
  m.def(
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
      py::arg("stream"), py::arg("layer"), py::arg("experts") = py::none());
  m.def(
      "after_layer", [](Stream& self, std::uint32_t l) { self.get().after_layer(l); },
      py::arg("stream"), py::arg("layer"));
  m.def("end_turn", [](Stream& self) { self.get().end_turn(); }, py::arg("stream"));
  m.def(
      "plan",
      [](Stream& self, std::uint32_t layer, const py::object& experts) {
        auto& s = self.get();
        const auto ids = ids_arg(experts, "plan", s.layout().n_experts);
        py::array_t<std::uint8_t> out(py::ssize_t(ids.size()));
        s.plan(layer, ids.data(), ids.size(), out.mutable_data());
        return out;
      },
      py::arg("stream"), py::arg("layer"), py::arg("experts"));
  m.def("release_plan", [](Stream& self) { self.get().release_plan(); }, py::arg("stream"));
  m.def(
      "cancel",
      [](Stream& self, const py::object& layer, const py::object& expert) {
        auto& s = self.get();
        const PackLayout& L = s.layout();
        return s.cancel(index_arg(layer, L.n_layers, "layer"),
                        index_arg(expert, L.n_experts, "expert"));
      },
      py::arg("stream"), py::arg("layer"), py::arg("expert"));
  m.def(
      "retire_unused_pre",
      [](Stream& self, std::uint32_t layer, const py::object& chosen) {
        auto& s = self.get();
        const auto ids = ids_arg(chosen, "chosen", s.layout().n_experts);
        return s.retire_unused_pre(layer, ids.data(), ids.size());
      },
      py::arg("stream"), py::arg("layer"), py::arg("chosen"));
  m.def("release_limbo", [](Stream& self) { return self.get().release_limbo(); },
        py::arg("stream"));
  m.def(
      "victim",
      [](Stream& self, bool spec) { return StreamTesting::victim(self.get(), spec); },
      py::arg("stream"), py::arg("speculative") = false, "The slot eviction would pick now; -1: none.");
}

// The stream's maps, its part split and its clients, read directly.
void bind_views(py::module_& m) {
  m.def(
      "smap",
      [](py::object obj) {
        auto& s = obj.cast<Stream&>().get();
        return read_only_view(s.smap(), py::ssize_t(s.layout().n_keys()), obj);
      },
      py::arg("stream"), "Read-only view of the device-visible slot map (ABSENT = 0xFFFFFFFF).");
  m.def(
      "key",
      [](Stream& self, std::int64_t layer, std::int64_t expert) {
        return self.get().key(layer, expert);
      },
      py::arg("stream"), py::arg("layer"), py::arg("expert"));
  m.def(
      "where",
      [](Stream& self, std::int64_t layer, std::int64_t expert) {
        return self.get().where(layer, expert);
      },
      py::arg("stream"), py::arg("layer"), py::arg("expert"),
      "The slot holding (layer, expert) in any state; -1: none.");
  m.def(
      "slot_bytes",
      [](py::object obj, const py::object& slot) {
        auto& s = obj.cast<Stream&>().get();
        const std::uint32_t i = index_arg(slot, s.n_slots(), "slot");
        return read_only_view(s.arena().slot(i), py::ssize_t(s.layout().record_bytes), obj);
      },
      py::arg("stream"), py::arg("slot"));
  m.def("n_parts", [](Stream& self) { return self.get().n_parts(); }, py::arg("stream"));
  m.def("part_bytes", [](Stream& self) { return self.get().part_bytes(); }, py::arg("stream"));
  m.def("n_clients", [](Stream& self) { return self.get().n_clients(); }, py::arg("stream"));
  m.def(
      "clients_waiting_for_space",
      [](Stream& self) { return self.get().clients_waiting_for_space(); }, py::arg("stream"));
}

}  // namespace

void init_testing(py::module_& parent) {
  py::module_ m = parent.def_submodule(
      "testing", "Test hooks: manual IO, read faults, eviction by hand, the invariant scan.");
  m.def(
      "raise_engine_error",
      [](int kind, const std::string& what) {
        if (kind < int(ErrorKind::Pack) || kind > int(ErrorKind::Device))
          throw py::value_error("raise_engine_error: no ErrorKind " + std::to_string(kind));
        throw EngineError(ErrorKind(kind), what);
      },
      py::arg("kind"), py::arg("what"),
      "Throws the engine's EngineError of ErrorKind `kind` (its C++ order), to check that the "
      "bindings translate every kind into its strata_stream.errors class.");
  m.def(
      "pending_jobs",
      [](Stream& self) {
        py::list out;
        for (const JobInfo& j : StreamTesting::pending_jobs(self.get()))
          out.append(py::make_tuple(j.slot, j.key, j.part, j.cls));
        return out;
      },
      py::arg("stream"),
      "Queued part reads in the order the IO threads would take them: (slot, key, part, cls).");
  m.def(
      "run_job",
      [](Stream& self, const py::object& index) {
        ExpertStream& s = self.get();
        const std::int64_t i = int_arg(index, "index");
        if (i < 0) throw py::index_error("run_job: index " + std::to_string(i) + " is negative");
        py::gil_scoped_release nogil;
        return StreamTesting::run_job(s, std::size_t(i));
      },
      py::arg("stream"), py::arg("index") = 0,
      "Manual IO (io_threads=0): performs the index-th pending part read now; False when there "
      "is none.");
  m.def("inject_fault", &inject_fault, py::arg("stream"), py::kw_only(), py::arg("layer"),
        py::arg("expert"), py::arg("part") = -1, py::arg("kind") = "eio", py::arg("count") = 1,
        py::arg("errno_value") = 5, py::arg("delay_s") = 0.0,
        "Makes the next `count` reads (-1: every read) of a record part (-1: any part) "
        "misbehave: 'eio' fails with errno_value, 'short' returns short, 'delay' stalls delay_s "
        "and then reads.");
  m.def(
      "clear_faults", [](Stream& self) { StreamTesting::faults(self.get()).clear(); }, py::arg("stream"));
  m.def(
      "evict_one", [](Stream& self) { return StreamTesting::evict_one(self.get()); }, py::arg("stream"),
      "Evicts the slot victim() picks; returns it, or -1 when none may go.");
  m.def(
      "check_invariants", [](Stream& self) { return StreamTesting::check_invariants(self.get()); },
      py::arg("stream"), "'' when the engine's invariant scan (I1, I3-I7) passes, else the violation.");
  bind_handshake(m);
  bind_views(m);
}

}  // namespace strata::python
