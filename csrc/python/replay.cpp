// _core.replay_trace: a routing trace through the product's own Window and ExpertStream, with
// nothing computed (strata_stream.trace.replay, the `strata-stream replay` command). Each step
// is the externally routed call a model makes for one token at one layer
// (Window::moe_routed_external), so the handshake replayed is the one that runs: protections,
// urgent requests, publication, predictions queued within the budget, limbo, turn ends. Nothing
// here re-states it, so a replay cannot drift from the product.
//
// The stream is a simulated one with manual IO (io_threads = 0, simulate_io): an urgent wait
// runs its slot's part reads inline, and after each step every queued read runs (the stream's
// settle), so speculative reads land before the next step and a replay gives the same figures
// on every run and every machine.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "arguments.h"
#include "bindings.h"
#include "common/errors.h"
#include "exec/backend.h"
#include "exec/window.h"
#include "stream.h"

namespace strata::python {

namespace {

// The replay's device: computes nothing, and every Signal it is given is raised at once. Only
// externally routed calls run on it (the caller computes the experts), which submit nothing; a
// submission that would wait for the host is refused, since nothing would ever release it.
class ReplayBackend final : public Backend {
 public:
  std::string name() const override { return "replay"; }
  void bind(const DeviceBuffers&) override {}
  void submit(const std::vector<Command>& commands) override {
    for (const Command& c : commands) {
      if (c.op == Op::Signal) c.event->signal(c.value);
      if (c.op == Op::Wait && c.event->value() < c.value)
        throw std::logic_error("the replay backend runs externally routed calls only");
    }
  }
  void synchronize() override {}
  void abort_pending() override {}
  std::string take_device_error() override { return {}; }
};

// steps: [n] layer of each step; ids, pred1: [n, top_k] (pred1 may be None: no prediction).
// Every step is one token at one layer, the tokens' passes in order: 0, 1, ... up to L-1 or
// short of it, then the next token's 0 (the Window refuses any other order by name).
py::dict replay_trace(Stream& stream, const py::array_t<std::int32_t, py::array::c_style>& steps,
                      const py::array_t<std::int32_t, py::array::c_style>& ids,
                      const py::object& pred1) {
  ExpertStream& s = stream.get();
  const PackLayout& L = s.layout();
  if (!s.options().simulate_io || s.options().io_threads != 0)
    throw EngineError(ErrorKind::Config,
                      "replay_trace needs a simulated stream with manual IO (io_threads=0)");
  const std::uint32_t k = L.top_k;
  const auto n = std::size_t(steps.size());
  if (ids.ndim() != 2 || std::size_t(ids.shape(0)) != n || std::size_t(ids.shape(1)) != k)
    throw py::value_error("ids must have shape [" + std::to_string(n) + ", " + std::to_string(k) +
                          "]");
  std::vector<std::int32_t> pred;
  if (!pred1.is_none()) pred = id_table_arg(pred1, "pred1", std::uint32_t(n), k, L.n_experts, true);
  WindowOptions o;
  o.lookahead = !pred.empty();  // the caller's next-layer predictions, where it has them
  // Speculation beyond what the trace brings is off, so that the figures are the policy's
  // and the predictions' alone: no turn-start reads, no profile fallback, and no back-off
  // governor (it samples wall time).
  o.start_layers = 0;
  o.profile_prefetch = false;
  o.prefetch_backoff = false;
  o.max_rows = 1;
  const std::int32_t* layer_of = steps.data();
  const std::int32_t* id = ids.data();
  std::uint64_t hits = 0, misses = 0;
  {
    py::gil_scoped_release nogil;
    Window w(s, std::make_unique<ReplayBackend>(), o);
    const Window::WaveCompute nothing = [](std::uint32_t, std::uint32_t, const std::uint32_t*) {};
    for (std::size_t i = 0; i < n; ++i) {
      // A pass that stopped short of the last layer (llama.cpp skips the last layer for prompt
      // tokens whose output nothing reads) ends its turn before the next token's layer 0.
      if (layer_of[i] == 0 && w.in_turn()) w.end_turn();
      Window::Routed r;
      r.ids = id + i * k;
      if (!pred.empty() && i + 1 < n && layer_of[i + 1] == layer_of[i] + 1)
        r.pred1 = pred.data() + i * k;
      w.moe_routed_external(std::uint32_t(layer_of[i]), 1, r, nothing, check_signals);
      s.settle(check_signals);
    }
    w.end_turn();  // a last token cut short of the last layer
    for (const LayerStats& st : w.layer_stats()) {
      hits += st.hits;
      misses += st.misses;
    }
    w.close();
  }
  py::dict d;
  d["hits"] = hits;
  d["misses"] = misses;
  return d;
}

}  // namespace

void init_replay(py::module_& m) {
  m.def("replay_trace", &replay_trace, py::arg("stream"), py::arg("steps"), py::arg("ids"),
        py::arg("pred1") = py::none(),
        "Replays routing steps (one token at one layer each) through a Window on a simulated "
        "stream, computing nothing; returns the urgent hits and misses.");
}

}  // namespace strata::python
