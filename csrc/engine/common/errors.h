// Engine exceptions. Each carries a Kind so the Python bindings can map it onto the
// strata_stream.errors hierarchy without parsing messages.
#pragma once

#include <stdexcept>
#include <string>

namespace strata {

// Turn: a Window call out of turn order, or on a turn another thread owns.
// Device: the backend's device reported a fault (a CUDA error, a kernel that met an expert the
// slot map did not publish); the Window's call failed and the stream stays usable.
enum class ErrorKind { Pack, Config, ExpertRead, Closed, Timeout, ArenaFull, Turn, Device };

class EngineError : public std::runtime_error {
 public:
  EngineError(ErrorKind kind, const std::string& what) : std::runtime_error(what), kind_(kind) {}
  ErrorKind kind() const noexcept { return kind_; }

 private:
  ErrorKind kind_;
};

// A failed urgent read: names what the user needs to find the bad bytes.
class ExpertReadError : public EngineError {
 public:
  ExpertReadError(const std::string& what, int layer, int expert, unsigned long long offset,
                  int err)
      : EngineError(ErrorKind::ExpertRead, what),
        layer(layer), expert(expert), offset(offset), err(err) {}
  int layer;
  int expert;
  unsigned long long offset;
  int err;  // errno, or 0 for a short read / checksum mismatch
};

}  // namespace strata
