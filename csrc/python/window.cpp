// _core.Window and _core.WindowOptions: the MoE layer calls (docs/architecture.md section 2).
// The Python Window builds a WindowOptions from its StreamConfig; the engine's Window checks
// the options and every routed id itself (exec/window.cpp), once, for C++ callers and these
// bindings alike.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <climits>
#include <memory>

#include "arguments.h"
#include "cuda_loader.h"
#include "exec/window.h"
#include "stream.h"
#include "exec/backend_registry.h"

namespace strata::python {

namespace {

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

// ---- WindowOptions ----------------------------------------------------------------------------

// A field set from Python: converted by arguments.h (a ConfigError naming it when the type is
// wrong or the value does not fit); what range the engine accepts is validate()'s to say.
template <std::uint32_t WindowOptions::*Field>
void uint32_field(py::class_<WindowOptions>& c, const char* name) {
  c.def_property(
      name, [](const WindowOptions& o) { return o.*Field; },
      [name](WindowOptions& o, const py::object& v) {
        o.*Field = std::uint32_t(option_uint(v, UINT32_MAX, name));
      });
}

template <bool WindowOptions::*Field>
void bool_field(py::class_<WindowOptions>& c, const char* name) {
  c.def_property(
      name, [](const WindowOptions& o) { return o.*Field; },
      [name](WindowOptions& o, const py::object& v) { o.*Field = option_bool(v, name); });
}

const char* moce_name(MoceMode m) {
  switch (m) {
    case MoceMode::Off: return "off";
    case MoceMode::Scale: return "scale";
    case MoceMode::Prune: return "prune";
  }
  return "off";
}

void bind_options(py::module_& m) {
  py::class_<WindowOptions> c(m, "WindowOptions",
                              "A Window's configuration (exec/window.h WindowOptions); the "
                              "Python Window fills it from its StreamConfig.");
  c.def(py::init<>())
      .def("validate", [](const WindowOptions& o) { o.validate(); },
           "ConfigError naming the first field out of range (for any pack; the Window checks "
           "the pack's own limits when it is made).");
  bool_field<&WindowOptions::lookahead>(c, "lookahead");
  bool_field<&WindowOptions::split_turn>(c, "split_turn");
  bool_field<&WindowOptions::two_layer_prompt>(c, "two_layer_prompt");
  bool_field<&WindowOptions::two_layer_decode>(c, "two_layer_decode");
  bool_field<&WindowOptions::prompt_buf_reuse>(c, "prompt_buf_reuse");
  bool_field<&WindowOptions::record_routes>(c, "record_routes");
  bool_field<&WindowOptions::profile_prefetch>(c, "profile_prefetch");
  bool_field<&WindowOptions::prefetch_backoff>(c, "prefetch_backoff");
  c.def_property(
      "device_timeout_s", [](const WindowOptions& o) { return o.device_timeout_s; },
      [](WindowOptions& o, const py::object& v) {
        o.device_timeout_s = option_float(v, "device_timeout_s");
      });
  uint32_field<&WindowOptions::max_rows>(c, "max_rows");
  uint32_field<&WindowOptions::decode_rows>(c, "decode_rows");
  uint32_field<&WindowOptions::decode_batch_rows>(c, "decode_batch_rows");
  uint32_field<&WindowOptions::two_layer_max>(c, "two_layer_max");
  uint32_field<&WindowOptions::start_layers>(c, "start_layers");
  c.def_property(
      "moce", [](const WindowOptions& o) { return std::string(moce_name(o.moce.mode)); },
      [](WindowOptions& o, const py::object& v) {
        const auto mode = py::isinstance<py::str>(v) ? v.cast<std::string>() : std::string();
        if (mode == "off")
          o.moce.mode = MoceMode::Off;
        else if (mode == "scale")
          o.moce.mode = MoceMode::Scale;
        else if (mode == "prune")
          o.moce.mode = MoceMode::Prune;
        else
          throw EngineError(ErrorKind::Config,
                            "moce must be off, scale or prune, got " + std::string(py::repr(v)));
      });
  c.def_property(
      "moce_strength", [](const WindowOptions& o) { return o.moce.strength; },
      [](WindowOptions& o, const py::object& v) {
        o.moce.strength = float(option_float(v, "moce_strength"));
      });
  c.def_property(
      "moce_keep_top", [](const WindowOptions& o) { return o.moce.keep_top; },
      [](WindowOptions& o, const py::object& v) {
        o.moce.keep_top = std::uint32_t(option_uint(v, UINT32_MAX, "moce_keep_top"));
      });
}

// ---- the layer calls ------------------------------------------------------------------------

WindowHolder make_window(Stream& stream, const WindowOptions& options, const std::string& backend,
                         const py::object& threads) {
  const unsigned n_threads = count_arg(threads, 1024, "threads", " (0 = one per core)");
  ExpertStream& es = stream.get();
  // "cuda" and "auto" may need strata_stream._cuda: importing it needs the GIL.
  if (backend == "cuda" || backend == "auto") register_cuda_backend(backend == "cuda");
  py::gil_scoped_release nogil;
  return WindowHolder(new Window(
      es,
      make_backend(backend, BackendOptions{n_threads, {}},
                   {route_capability(es.layout(), options.moce)}),
      options));
}

py::array_t<float> moe(Window& w, std::uint32_t layer, const py::array& x) {
  const PackLayout& L = w.layout();
  if (x.ndim() != 2)
    throw py::value_error("x must be 2-D [rows, " + std::to_string(L.hidden) + "], got " +
                          std::to_string(x.ndim()) + " dimensions");
  if (!x.dtype().is(py::dtype::of<float>()))
    throw py::type_error("x must be float32, got " + dtype_name(x));
  if (x.shape(1) != py::ssize_t(L.hidden))
    throw py::value_error("x must have shape [rows, " + std::to_string(L.hidden) + "], got [" +
                          std::to_string(x.shape(0)) + ", " + std::to_string(x.shape(1)) + "]");
  if (!(x.flags() & py::array::c_style)) throw py::value_error("x must be C-contiguous");
  if (x.shape(0) > py::ssize_t(UINT32_MAX)) throw py::value_error("x has too many rows");
  const std::uint32_t rows = std::uint32_t(x.shape(0));
  py::array_t<float> out({py::ssize_t(rows), py::ssize_t(L.hidden)});
  const float* src = static_cast<const float*>(x.data());
  float* dst = out.mutable_data();
  {
    py::gil_scoped_release nogil;
    w.moe(layer, src, rows, dst, check_signals);
  }
  return out;
}

// The rounding an externally routed call asks for. "mlx": MLX's own arithmetic for x's dtype
// (bfloat16 or float32).
Rounding routed_rounding(Window::XType xt, const std::string& arithmetic,
                         const std::string& weights_dtype) {
  if (arithmetic != "float32" && arithmetic != "mlx")
    throw EngineError(ErrorKind::Config,
                      "arithmetic must be 'float32' or 'mlx', got '" + arithmetic + "'");
  if (weights_dtype != "float32" && weights_dtype != "bfloat16")
    throw EngineError(ErrorKind::Config,
                      "weights_dtype must be 'float32' or 'bfloat16', got '" + weights_dtype + "'");
  Rounding r;
  if (arithmetic == "mlx") {
    if (xt == Window::XType::F16)
      throw EngineError(ErrorKind::Config,
                        "arithmetic='mlx' reproduces MLX for bfloat16 and float32 inputs, not "
                        "float16");
    r.arithmetic = xt == Window::XType::BF16 ? Arithmetic::MlxBfloat16 : Arithmetic::MlxFloat32;
    r.weights_bf16 = weights_dtype == "bfloat16";
  }
  return r;
}

const std::int32_t* or_null(const std::vector<std::int32_t>& v) {
  return v.empty() ? nullptr : v.data();
}

// A routed call's tables, checked and copied once (ids, mixture weights, predictions), owned
// for as long as the call runs; routed() points a Window::Routed at them.
struct RoutedTables {
  std::vector<std::int32_t> ids, pred1, pred2;
  std::vector<float> weights;

  RoutedTables(const PackLayout& L, std::uint32_t rows, const py::object& ids_arg,
               const py::object& weights_arg, const py::object& pred1_arg,
               const py::object& pred2_arg, bool per_entry = false) {
    const std::uint32_t k = L.top_k, E = L.n_experts;
    ids = id_table_arg(ids_arg, "ids", rows, k, E, true);
    pred1 = id_table_arg(pred1_arg, "pred1", rows, k, E, false);
    pred2 = id_table_arg(pred2_arg, "pred2", rows, k, E, false);
    if (weights_arg.is_none()) {
      if (!per_entry)
        throw py::type_error("weights (the mixture weights) are needed unless per_entry=True");
      // Per-entry outputs without weights: each entry's expert output itself.
      weights.assign(std::size_t(rows) * k, 1.0f);
      return;
    }
    using FloatArray = py::array_t<float, py::array::c_style | py::array::forcecast>;
    FloatArray wts = FloatArray::ensure(weights_arg);
    if (!wts) throw py::type_error("weights must be an array of mixture weights");
    if (wts.ndim() != 2 || std::uint32_t(wts.shape(0)) != rows ||
        std::uint32_t(wts.shape(1)) != k)
      throw py::value_error("weights must have shape [" + std::to_string(rows) + ", " +
                            std::to_string(k) + "]");
    weights.assign(wts.data(), wts.data() + std::size_t(rows) * k);
  }
  Window::Routed routed() const {
    Window::Routed r;
    r.ids = ids.data();
    r.weights = weights.data();
    r.pred1 = or_null(pred1);
    r.pred2 = or_null(pred2);
    return r;
  }
};

// x as a [T, hidden] buffer of float32, float16 or bfloat16 (an evaluated mx.array is read in
// place); the tables are copied under the GIL, so another thread writing the caller's arrays
// cannot change an id after the engine checked it.
py::array_t<float> moe_routed(Window& w, std::uint32_t layer, const py::buffer& x,
                              const std::string& dtype, const py::object& ids,
                              const py::object& weights, const py::object& pred1,
                              const py::object& pred2, const std::string& arithmetic,
                              const std::string& weights_dtype, bool per_entry) {
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
    throw py::type_error("x must be float32, float16 or bfloat16, got " + dtype);
  }
  if (xb.ndim != 2 || std::uint32_t(xb.shape[1]) != L.hidden)
    throw py::value_error("x must have shape [T, " + std::to_string(L.hidden) + "]");
  if (std::size_t(xb.itemsize) != item)
    throw py::value_error("x itemsize " + std::to_string(xb.itemsize) +
                          " does not match dtype " + dtype);
  if (xb.strides[1] != py::ssize_t(item) ||
      xb.strides[0] != py::ssize_t(item) * py::ssize_t(L.hidden))
    throw py::value_error("x must be C-contiguous");
  const std::uint32_t rows = std::uint32_t(xb.shape[0]);
  const RoutedTables tables(L, rows, ids, weights, pred1, pred2, per_entry);
  Window::Routed r = tables.routed();
  r.rounding = routed_rounding(xt, arithmetic, weights_dtype);
  r.per_entry = per_entry;
  // Per entry: [rows, top_k, hidden], each entry's output (weighted, unsummed).
  py::array_t<float> out = per_entry ? py::array_t<float>({py::ssize_t(rows),
                                                           py::ssize_t(L.top_k),
                                                           py::ssize_t(L.hidden)})
                                     : py::array_t<float>({py::ssize_t(rows),
                                                           py::ssize_t(L.hidden)});
  float* dst = out.mutable_data();
  {
    py::gil_scoped_release nogil;
    w.moe_routed(layer, xb.ptr, xt, rows, r, dst, check_signals);
  }
  return out;
}

// x and out as device addresses of float32 [rows, hidden] rows (window.py takes them from the
// arrays' __cuda_array_interface__, checked there: dtype, shape, contiguity, writability); the
// backend checks that both are memory of its device. The tables are copied as for moe_routed.
void moe_routed_device(Window& w, std::uint32_t layer, std::uintptr_t x, std::uintptr_t out,
                       const py::object& rows_arg, const py::object& ids,
                       const py::object& weights, const py::object& pred1,
                       const py::object& pred2, std::optional<std::uintptr_t> stream) {
  const PackLayout& L = w.layout();
  const std::uint32_t rows = count_arg(rows_arg, UINT32_MAX, "rows");
  if (rows > 0 && (x == 0 || out == 0))
    throw py::value_error("x and out must be device addresses, got a null pointer");
  const std::size_t bytes = std::size_t(rows) * L.hidden * 4;
  if (rows > 0 && x < out + bytes && out < x + bytes)
    throw py::value_error("x and out must not overlap");
  const RoutedTables tables(L, rows, ids, weights, pred1, pred2);
  const Window::Routed r = tables.routed();
  py::gil_scoped_release nogil;
  w.moe_routed_device(layer, reinterpret_cast<const float*>(x), rows, r,
                      reinterpret_cast<float*>(out), check_signals, stream);
}

void moe_routed_external(Window& w, std::uint32_t layer, const py::object& ids,
                     const py::object& pred1, const py::object& pred2,
                     const py::function& compute) {
  const PackLayout& L = w.layout();
  const std::uint32_t k = L.top_k, E = L.n_experts;
  py::array ids_a = py::array::ensure(ids);
  if (!ids_a || ids_a.ndim() != 2)
    throw py::value_error("ids must have shape [T, " + std::to_string(k) + "]");
  const std::uint32_t rows = std::uint32_t(ids_a.shape(0));
  const auto ids_v = id_table_arg(ids_a, "ids", rows, k, E, true);
  const auto pred1_v = id_table_arg(pred1, "pred1", rows, k, E, false);
  const auto pred2_v = id_table_arg(pred2, "pred2", rows, k, E, false);
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
}

// ---- what a Window learned and measured ---------------------------------------------------

py::object none_if_negative(double v, double scale = 1.0) {
  return v < 0 ? py::object(py::none()) : py::object(py::float_(v * scale));
}

py::dict prefetch_stats(Window& w) {
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
  d["last_precision"] = none_if_negative(g.last_precision());
  d["last_busy"] = none_if_negative(g.last_busy());
  d["trials"] = g.trials();
  d["abandoned_trials"] = g.abandoned_trials();
  d["deterministic"] = g.options().deterministic;  // timing-free (settled moce)
  // Mean wall time of a decode layer call with and without speculation, last trial.
  d["last_wall_on_s"] = none_if_negative(g.last_wall_on(), 1e-9);
  d["last_wall_off_s"] = none_if_negative(g.last_wall_off(), 1e-9);
  // The per-layer gate: each layer's cap on reads started for it (None: none), last precision.
  py::list caps, precision;
  for (std::uint32_t l = 0; l < g.layers_seen(); ++l) {
    caps.append(g.layer_cap(l) == PrefetchGovernor::kUnlimited ? py::object(py::none())
                                                              : py::int_(g.layer_cap(l)));
    precision.append(none_if_negative(g.layer_precision(l)));
  }
  d["layer_caps"] = caps;
  d["layer_precision"] = precision;
  d["layer_gates"] = g.layer_gates();
  return d;
}

void set_profile(Window& w, const py::array& a) {
  const PackLayout& L = w.layout();
  const py::ssize_t want = py::ssize_t(L.n_layers) * L.n_experts;
  const bool shaped = (a.ndim() == 1 && a.shape(0) == want) ||
                      (a.ndim() == 2 && a.shape(0) == py::ssize_t(L.n_layers) &&
                       a.shape(1) == py::ssize_t(L.n_experts));
  if (!shaped)
    throw py::value_error("profile must have n_layers * n_experts = " + std::to_string(want) +
                          " counts ([" + std::to_string(L.n_layers) + ", " +
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
      throw py::value_error("profile count " + std::to_string(v[i]) + " out of range [0, 2^32)");
    counts[i] = std::uint32_t(v[i]);
  }
  py::gil_scoped_release nogil;  // waits for no call, but takes the Window's locks
  w.set_profile(counts);
}

py::list layer_stats(Window& w) {
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
}

template <class T>
py::array_t<T> to_array(const std::vector<T>& v) {
  py::array_t<T> a(py::ssize_t(v.size()));
  std::copy(v.begin(), v.end(), a.mutable_data());
  return a;
}

}  // namespace

void init_window(py::module_& m) {
  bind_options(m);

  py::class_<Window, WindowHolder>(m, "Window")
      .def(py::init(&make_window), py::keep_alive<1, 2>(), py::arg("stream"),
           py::arg("options") = WindowOptions{}, py::kw_only(), py::arg("backend") = "cpu",
           py::arg("threads") = 0)
      // ---- the layer calls ----
      .def("moe", &moe, py::arg("layer"), py::arg("x"))
      .def("moe_routed", &moe_routed, py::arg("layer"), py::arg("x"), py::arg("dtype"),
           py::arg("ids"), py::arg("weights"), py::arg("pred1") = py::none(),
           py::arg("pred2") = py::none(), py::kw_only(), py::arg("arithmetic") = "float32",
           py::arg("weights_dtype") = "float32", py::arg("per_entry") = false)
      .def_property_readonly("per_entry_unsupported", &Window::per_entry_unsupported)
      .def("moe_routed_device", &moe_routed_device, py::arg("layer"), py::arg("x"),
           py::arg("out"), py::arg("rows"), py::arg("ids"), py::arg("weights"),
           py::arg("pred1") = py::none(), py::arg("pred2") = py::none(),
           py::arg("stream") = py::none())
      .def_property_readonly("device_io_unsupported", &Window::device_io_unsupported)
      .def_property_readonly("completion_pending", &Window::completion_pending)
      .def("moe_routed_external", &moe_routed_external, py::arg("layer"), py::arg("ids"),
           py::arg("pred1"), py::arg("pred2"), py::arg("compute"))
      .def(
          "arithmetic_unsupported",
          [](const Window& w, const std::string& x_dtype, const py::object& layer) {
            // Why moe_routed(arithmetic="mlx") cannot run for inputs of x_dtype (at `layer`;
            // at every layer without one); "" when it can.
            if (x_dtype != "bfloat16" && x_dtype != "float32")
              throw EngineError(ErrorKind::Config,
                                "x_dtype must be 'bfloat16' or 'float32', got '" + x_dtype + "'");
            const Arithmetic a =
                x_dtype == "bfloat16" ? Arithmetic::MlxBfloat16 : Arithmetic::MlxFloat32;
            if (layer.is_none()) return w.arithmetic_unsupported(a);
            const std::uint32_t l = index_arg(layer, w.layout().n_layers, "layer");
            return w.arithmetic_unsupported(a, l);
          },
          py::arg("x_dtype"), py::arg("layer") = py::none())
      .def(
          "wants_predictions",
          [](const Window& w, std::uint32_t layer, const py::object& rows) {
            // (router l+1, router l+2): which predictions a routed call of `rows` rows uses.
            const Lookahead l = w.wants_predictions(layer, count_arg(rows, UINT32_MAX, "rows"));
            return py::make_tuple(l.next, l.two_layer);
          },
          py::arg("layer"), py::arg("rows"))
      .def(
          "pass_layer",
          [](Window& w, std::uint32_t layer) {
            // The turn moves past a layer this pass runs no rows of (Window::pass_layer).
            py::gil_scoped_release nogil;
            w.pass_layer(layer, check_signals);
          },
          py::arg("layer"))
      // ---- turns and lifecycle ----
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
      .def_property_readonly("backend_tuning", &Window::backend_tuning)
      // ---- figures, profile, routes ----
      .def_property_readonly("scratch_bytes", &Window::scratch_bytes)
      .def("reset_stats", &Window::reset_stats)
      .def_property_readonly("settles", &Window::settles)
      .def_property_readonly("route_layer", &Window::route_layer)
      .def("route_resident", [](Window& w) {
        const std::vector<std::uint8_t> r = w.route_resident();
        py::array_t<bool> a(py::ssize_t(r.size()));
        std::copy(r.begin(), r.end(), a.mutable_data());
        return a;
      })
      .def("prefetch_stats", &prefetch_stats)
      .def("profile", [](Window& w) { return to_array(w.profile()); })
      .def("set_profile", &set_profile, py::arg("counts"))
      .def("take_routes",
           [](Window& w) {
             std::vector<std::int32_t> r = w.take_routes();
             py::array_t<std::int32_t> a({py::ssize_t(r.size() / 3), py::ssize_t(3)});
             std::copy(r.begin(), r.end(), a.mutable_data());
             return a;
           })
      .def("layer_stats", &layer_stats);
}

}  // namespace strata::python
