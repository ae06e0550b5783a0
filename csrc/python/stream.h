// The engine's ExpertStream behind a Python object (_core.Stream). Window and the testing
// hooks take it as an argument, so its holder is shared by those binding files.
#pragma once

#include <memory>

#include "bindings.h"
#include "common/errors.h"
#include "residency/expert_stream.h"

namespace strata::python {

// Its IO threads are told to stop when the object goes; one stuck in a read keeps the stream
// (and its arena) alive on a background thread until the read returns, instead of blocking the
// garbage collector with the GIL held.
struct Stream {
  std::unique_ptr<ExpertStream> s;

  Stream() = default;
  explicit Stream(std::unique_ptr<ExpertStream> p) : s(std::move(p)) {}
  Stream(Stream&&) = default;
  ~Stream() {
    if (!s) return;
    const double bound = s->closed() ? 0.0 : 0.25;  // a closed one already waited its bound
    ExpertStream::dispose(std::move(s), bound);
  }

  ExpertStream& get() {
    if (!s) throw EngineError(ErrorKind::Closed, "ExpertStream is closed");
    return *s;
  }
};

}  // namespace strata::python
