// _core.testing: the hooks tests drive the engine with, off the product's Stream class. Manual
// IO (a stream made with io_threads=0 performs a part read only when told), injected read
// faults, eviction by hand and the engine's own invariant scan. strata_stream.testing is the
// Python face; every function takes the _core.Stream it acts on.
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
}

}  // namespace strata::python
