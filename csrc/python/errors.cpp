// Engine exceptions as strata_stream.errors: each ErrorKind is one class of that hierarchy, and
// an ExpertReadError carries the layer, expert, file offset and errno of the read that failed.
// The standard exceptions keep pybind11's mapping (std::out_of_range -> IndexError,
// std::invalid_argument -> ValueError).
#include "error_translation.h"

#include "common/errors.h"

namespace strata::python {

namespace {

const char* class_name(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::Pack: return "PackError";
    case ErrorKind::Config: return "ConfigError";
    case ErrorKind::ExpertRead: return "ExpertReadError";
    case ErrorKind::Closed: return "StreamClosedError";
    case ErrorKind::Timeout: return "StreamTimeoutError";
    case ErrorKind::ArenaFull: return "ArenaFullError";
    case ErrorKind::Turn: return "TurnError";
    case ErrorKind::Device: return "DeviceError";
  }
  return "StrataError";
}

}  // namespace

void translate_engine_errors(std::exception_ptr p) {
  try {
    if (p) std::rethrow_exception(p);
  } catch (const ExpertReadError& e) {
    py::module_ errors = py::module_::import("strata_stream.errors");
    py::object exc = errors.attr("ExpertReadError")(e.err, e.what());
    exc.attr("layer") = e.layer;
    exc.attr("expert") = e.expert;
    exc.attr("offset") = e.offset;
    PyErr_SetObject(errors.attr("ExpertReadError").ptr(), exc.ptr());
  } catch (const EngineError& e) {
    py::object cls = py::module_::import("strata_stream.errors").attr(class_name(e.kind()));
    PyErr_SetString(cls.ptr(), e.what());
  }
}

void init_errors(py::module_&) { py::register_exception_translator(&translate_engine_errors); }

}  // namespace strata::python
