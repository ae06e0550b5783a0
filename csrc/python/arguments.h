// Python arguments to the engine's types, shared by the binding files. These check only what
// the engine cannot see once a value is converted: a dtype, a shape, an int that does not fit
// its C++ type. Ranges against the pack (layer, expert ids) are the engine's to check, with its
// own message; an id that does not fit in int32 never reaches it, so it is refused here in the
// same words.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>
#include <vector>

namespace strata::python {

namespace py = pybind11;

// Polled by blocking waits (without the engine lock): lets Ctrl-C interrupt them.
void check_signals();

std::string dtype_name(const py::array& a);

// A Python int (or numpy integer; not a bool) as int64: TypeError naming `what` otherwise.
// Ints beyond int64 come back clamped to its range, so every range check below refuses them.
std::int64_t int_arg(const py::handle& obj, const char* what);

// An index into [0, bound): IndexError "`what` V out of range [0, bound)" otherwise.
std::uint32_t index_arg(const py::handle& obj, std::uint64_t bound, const char* what);

// A count in [0, max]: ConfigError "`what` must be 0..max`note`, got V" otherwise.
std::uint32_t count_arg(const py::handle& obj, std::uint32_t max, const char* what,
                        const char* note = "");

// A setting's value (StreamOptions, WindowOptions; docs/settings.md), converted once where
// Python hands it over: a wrong type is a ConfigError naming the setting, as a value out of
// the C++ type's range is ("`what` must be 0..max, got V"). The ranges the engine accepts are
// validate()'s to check (exec/window_options.h), with their own message.
bool option_bool(const py::handle& obj, const char* what);  // a bool, not 0/1
std::uint64_t option_uint(const py::handle& obj, std::uint64_t max, const char* what);
double option_float(const py::handle& obj, const char* what);  // a real number, not a bool

// Expert ids from a 0-d or 1-d integer array (or a sequence), copied while the GIL is held so
// that another thread writing the caller's array cannot change them after they were checked.
std::vector<std::int32_t> ids_arg(const py::handle& obj, const char* what,
                                  std::uint32_t n_experts);

// A [rows, k] table of expert ids (routed ids, pred1, pred2), copied under the GIL as above;
// empty for None unless `required`.
std::vector<std::int32_t> id_table_arg(const py::handle& obj, const char* what,
                                       std::uint32_t rows, std::uint32_t k,
                                       std::uint32_t n_experts, bool required);

// A read-only numpy view of n elements of engine memory, keeping `owner` alive.
template <class T>
py::array_t<T> read_only_view(const T* data, py::ssize_t n, py::handle owner) {
  py::array_t<T> a({n}, {py::ssize_t(sizeof(T))}, data, owner);
  py::detail::array_proxy(a.ptr())->flags &= ~py::detail::npy_api::NPY_ARRAY_WRITEABLE_;
  return a;
}

}  // namespace strata::python
