#include "exec/backend_support.h"

#include "common/errors.h"
#include "exec/window_options.h"

namespace strata {

std::optional<std::string> experts_unsupported(const Backend& backend, const PackLayout& layout) {
  const std::string name = backend.name();
  if (name != "metal" && name != "cuda") return std::nullopt;
  if (!layout.gated)
    return "the " + name + " backend computes gated experts (gate, up, down) only; this pack's "
           "have no gate (activation " + activation_name(layout.activation) + ": the cpu "
           "backend computes them)";
  if (layout.activation != Activation::SwiGLU && layout.activation != Activation::SwigluOai)
    return "the " + name + " backend computes activations swiglu and swiglu_oai only; this "
           "pack's is " + activation_name(layout.activation) + " (the cpu backend computes it)";
  return std::nullopt;
}

BackendSupport::BackendSupport(Backend& backend, const PackLayout& layout,
                               const MoceParams& moce) {
  if (auto why = experts_unsupported(backend, layout))
    throw EngineError(ErrorKind::Config, "backend '" + backend.name() + "': " + *why);
  // The capabilities a call may need: the expert passes' arithmetic (a routed call chooses it)
  // and the route's moce mode (the Window's own).
  class_arithmetic.resize(layout.classes.size());
  for (Arithmetic a : {Arithmetic::Float32, Arithmetic::MlxBfloat16, Arithmetic::MlxFloat32}) {
    arithmetic[std::size_t(a)] =
        backend.unsupported(Capability{Op::MoeMM, &layout, a, MoceMode::Off}).value_or("");
    for (std::size_t c = 0; c < layout.classes.size(); ++c) {
      Capability one{Op::MoeMM, &layout, a, MoceMode::Off};
      one.format_class = std::int32_t(c);
      class_arithmetic[c][std::size_t(a)] = backend.unsupported(one).value_or("");
    }
  }
  device_io = backend
                  .unsupported(Capability{Op::Combine, &layout, Arithmetic::Float32,
                                          MoceMode::Off, Io::Device})
                  .value_or("");
  Capability entries{Op::Combine, &layout, Arithmetic::Float32, MoceMode::Off};
  entries.per_entry = true;
  per_entry = backend.unsupported(entries).value_or("");
  completes_async = device_io.empty() && backend.completes_async();
  if (auto why = backend.unsupported(route_capability(layout, moce)))
    throw EngineError(ErrorKind::Config, "backend '" + backend.name() + "': " + *why);
}

BackendSupport BackendSupport::all(const PackLayout& layout) {
  BackendSupport s;
  s.class_arithmetic.resize(layout.classes.size());
  return s;
}

}  // namespace strata
