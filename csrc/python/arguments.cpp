#include "arguments.h"

#include <climits>
#include <limits>

#include "common/errors.h"

namespace strata::python {

void check_signals() {
  py::gil_scoped_acquire gil;
  if (PyErr_CheckSignals() != 0) throw py::error_already_set();
}

std::string dtype_name(const py::array& a) { return py::str(a.dtype()).cast<std::string>(); }

std::int64_t int_arg(const py::handle& obj, const char* what) {
  if (PyBool_Check(obj.ptr()) || !PyIndex_Check(obj.ptr()))
    throw py::type_error(std::string(what) + " must be an int, got " +
                         std::string(py::str(py::type::handle_of(obj).attr("__name__"))));
  py::object index = py::reinterpret_steal<py::object>(PyNumber_Index(obj.ptr()));
  if (!index) throw py::error_already_set();
  int overflow = 0;
  const long long v = PyLong_AsLongLongAndOverflow(index.ptr(), &overflow);
  if (overflow > 0) return std::numeric_limits<std::int64_t>::max();
  if (overflow < 0) return std::numeric_limits<std::int64_t>::min();
  if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
  return std::int64_t(v);
}

namespace {

// The Python int as written (an int beyond int64 too), for messages.
std::string repr_int(const py::handle& obj) {
  return py::str(py::reinterpret_steal<py::object>(PyNumber_Index(obj.ptr())));
}

}  // namespace

std::uint32_t index_arg(const py::handle& obj, std::uint64_t bound, const char* what) {
  const std::int64_t v = int_arg(obj, what);
  if (v < 0 || std::uint64_t(v) >= bound)
    throw py::index_error(std::string(what) + " " + repr_int(obj) + " out of range [0, " +
                          std::to_string(bound) + ")");
  return std::uint32_t(v);
}

std::uint32_t count_arg(const py::handle& obj, std::uint32_t max, const char* what,
                        const char* note) {
  const std::int64_t v = int_arg(obj, what);
  if (v < 0 || v > std::int64_t(max))
    throw EngineError(ErrorKind::Config, std::string(what) + " must be 0.." + std::to_string(max) +
                                             note + ", got " + repr_int(obj));
  return std::uint32_t(v);
}

namespace {

[[noreturn]] void wrong_type(const py::handle& obj, const char* what, const char* expected) {
  throw EngineError(ErrorKind::Config, std::string(what) + ": expected " + expected + ", got " +
                                           std::string(py::repr(obj)));
}

}  // namespace

bool option_bool(const py::handle& obj, const char* what) {
  if (!PyBool_Check(obj.ptr())) wrong_type(obj, what, "a bool");
  return obj.ptr() == Py_True;
}

std::uint64_t option_uint(const py::handle& obj, std::uint64_t max, const char* what) {
  if (PyBool_Check(obj.ptr()) || !PyIndex_Check(obj.ptr())) wrong_type(obj, what, "an int");
  py::object index = py::reinterpret_steal<py::object>(PyNumber_Index(obj.ptr()));
  if (!index) throw py::error_already_set();
  const unsigned long long v = PyLong_AsUnsignedLongLong(index.ptr());
  if (PyErr_Occurred()) {  // negative, or beyond 64 bits
    PyErr_Clear();
    throw EngineError(ErrorKind::Config, std::string(what) + " must be 0.." + std::to_string(max) +
                                             ", got " + repr_int(obj));
  }
  if (v > max)
    throw EngineError(ErrorKind::Config, std::string(what) + " must be 0.." + std::to_string(max) +
                                             ", got " + repr_int(obj));
  return std::uint64_t(v);
}

double option_float(const py::handle& obj, const char* what) {
  // Any real number (a numpy float32 too), not a bool, a complex or a string.
  if (PyBool_Check(obj.ptr()) || PyComplex_Check(obj.ptr()) || !PyNumber_Check(obj.ptr()))
    wrong_type(obj, what, "a number");
  const double v = PyFloat_AsDouble(obj.ptr());
  if (v == -1.0 && PyErr_Occurred()) throw py::error_already_set();
  return v;
}

namespace {

// The ids of an integer array, each checked to fit in int32 (a wider one would wrap into
// another expert). `what` names the argument; n_experts is for the message only.
std::vector<std::int32_t> int32_ids(const py::array& a, const char* what,
                                    std::uint32_t n_experts) {
  if (a.size() == 0) return {};
  const char kind = a.dtype().kind();
  if (kind != 'i' && kind != 'u')
    throw py::type_error(std::string(what) + ": expert ids must be integers, got dtype " +
                         dtype_name(a));
  // A uint64 id past INT64_MAX would wrap to a negative one here, which is refused all the same.
  auto wide = py::array_t<std::int64_t, py::array::c_style | py::array::forcecast>::ensure(a);
  if (!wide) throw py::type_error(std::string(what) + ": expert ids must fit in int64");
  std::vector<std::int32_t> out(std::size_t(wide.size()));
  const std::int64_t* v = wide.data();
  for (std::size_t i = 0; i < out.size(); ++i) {
    if (v[i] < INT32_MIN || v[i] > INT32_MAX)  // the engine refuses every other id itself
      throw py::index_error(std::string(what) + ": expert " + std::to_string(v[i]) +
                            " out of range [0, " + std::to_string(n_experts) + ")");
    out[i] = std::int32_t(v[i]);
  }
  return out;
}

}  // namespace

std::vector<std::int32_t> ids_arg(const py::handle& obj, const char* what,
                                  std::uint32_t n_experts) {
  py::array a = py::array::ensure(obj);
  if (!a) throw py::type_error(std::string(what) + ": expected an array of expert ids");
  if (a.ndim() > 1)
    throw py::value_error(std::string(what) + ": expected a 1-D array of expert ids, got " +
                          std::to_string(a.ndim()) + " dimensions");
  return int32_ids(a, what, n_experts);
}

std::vector<std::int32_t> id_table_arg(const py::handle& obj, const char* what,
                                       std::uint32_t rows, std::uint32_t k,
                                       std::uint32_t n_experts, bool required) {
  if (obj.is_none()) {
    if (required) throw py::value_error(std::string(what) + " are required");
    return {};
  }
  py::array a = py::array::ensure(obj);
  if (!a) throw py::type_error(std::string(what) + ": expected an array of expert ids");
  std::string shape;
  for (py::ssize_t d = 0; d < a.ndim(); ++d)
    shape += (d ? ", " : "") + std::to_string(a.shape(d));
  if (a.ndim() != 2 || std::uint64_t(a.shape(0)) != rows || std::uint64_t(a.shape(1)) != k)
    throw py::value_error(std::string(what) + " must have shape [" + std::to_string(rows) + ", " +
                          std::to_string(k) + "], got [" + shape + "]");
  if (a.size() != 0 && a.dtype().kind() != 'i' && a.dtype().kind() != 'u')
    throw py::type_error(std::string(what) + " must be integer expert ids, got dtype " +
                         dtype_name(a));
  return int32_ids(a, what, n_experts);
}

}  // namespace strata::python
