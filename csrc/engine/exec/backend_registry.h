// Backends by name: a backend is one folder and one registration. cpu, the reference, is
// always registered; the ones built into _core (metal on macOS) are registered once by
// csrc/python/backends.cpp; one built as a separate extension (strata_stream._cuda) hands _core
// its factory at run time: a PyCapsule named kBackendFactoryCapsule holding a BackendFactory,
// passed to _core.register_backend(name, capsule).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "exec/backend.h"

namespace strata {

// Makes a backend, or throws EngineError(Config) with the reason it cannot (no device, ...).
using BackendFactory = std::unique_ptr<Backend> (*)(const BackendOptions&);

// The name of the PyCapsule that carries a BackendFactory between extension modules.
inline constexpr const char* kBackendFactoryCapsule = "strata_stream.BackendFactory";

// Registers `factory` under `name` (lower-case letters, digits, '_'; not "auto"). Throws
// EngineError(Config) for a bad name or one already taken by another factory; registering the
// same factory again is a no-op. Thread-safe.
void register_backend(const std::string& name, BackendFactory factory);

// Registered names, built-in ones first, in registration order.
std::vector<std::string> backend_names();

// The backend `name` ("auto": the first registered backend other than cpu that constructs and
// runs every capability in `needs`, else cpu). A named backend that lacks one of `needs`
// throws EngineError(Config) naming it; an unknown name lists the registered ones.
std::unique_ptr<Backend> make_backend(const std::string& name, const BackendOptions& options,
                                      const std::vector<Capability>& needs = {});

}  // namespace strata
