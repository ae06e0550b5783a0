// BackendSupport: what a Window's backend can do for its pack, asked once when the Window is
// built (Backend::unsupported, each answer a reason or ""), then read-only.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "exec/backend.h"

namespace strata {

// Why `backend` cannot compute the experts of `layout` (their activation kind, or experts
// without a gate), naming them; nullopt where it can. The cpu backend computes every kind; the
// metal and cuda backends' kernels compute the gated swiglu and swiglu_oai only. Asked with every
// capability (make_backend's `auto` then takes the cpu backend) and when a Window is built.
std::optional<std::string> experts_unsupported(const Backend& backend, const PackLayout& layout);

struct BackendSupport {
  // Throws EngineError(Config) naming the backend when it cannot run the Window's own route
  // (its moce mode).
  BackendSupport(Backend& backend, const PackLayout& layout, const MoceParams& moce);
  // Nothing refused, for `layout`'s format classes (what a test of a routed call's checks
  // starts from).
  static BackendSupport all(const PackLayout& layout);

  // The expert passes in each arithmetic: for every layer, and per format class of the pack.
  std::array<std::string, 3> arithmetic;
  std::vector<std::array<std::string, 3>> class_arithmetic;
  std::string device_io;  // Io::Device (moe_routed_device)
  std::string per_entry;  // per-entry outputs (Routed::per_entry)
  bool completes_async = false;  // Backend::completes_async(), where device IO is supported

 private:
  BackendSupport() = default;
};

}  // namespace strata
