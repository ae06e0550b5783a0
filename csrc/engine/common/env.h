// The one place C++ reads the process environment, as MLX's env:: getters are: every
// STRATA_* variable a backend takes passes through these, read once where the backend starts,
// so `grep -rn getenv csrc` finds this file alone. Python's settings are read by
// strata_stream/config.py and reach C++ as StreamOptions / WindowOptions, never through here.
//
// Header-only: the CUDA module shares nothing with _core but header-only engine types.
// A value that cannot be read is an EngineError(Config) naming the variable and what it takes.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <optional>
#include <string>
#include <string_view>

#include "common/errors.h"

namespace strata::env {

// The variable's text; nullopt when it is unset or empty.
inline std::optional<std::string> text(const char* name) {
  const char* v = std::getenv(name);
  if (!v || !*v) return std::nullopt;
  return std::string(v);
}

// Whether the variable is set at all (any text, empty included): the trace switches.
inline bool present(const char* name) { return std::getenv(name) != nullptr; }

// 1/0, true/false, yes/no, on/off (any case); `fallback` when unset.
inline bool flag(const char* name, bool fallback) {
  const auto v = text(name);
  if (!v) return fallback;
  std::string low;
  for (char c : *v) low += char(c >= 'A' && c <= 'Z' ? c - 'A' + 'a' : c);
  if (low == "1" || low == "true" || low == "yes" || low == "on") return true;
  if (low == "0" || low == "false" || low == "no" || low == "off") return false;
  throw EngineError(ErrorKind::Config,
                    std::string(name) + " must be 0/1/true/false, got '" + *v + "'");
}

// A decimal integer in [lo, hi] (`unit` names what it counts, for the message); `fallback`
// when unset.
inline std::int64_t integer(const char* name, std::int64_t fallback, std::int64_t lo,
                            std::int64_t hi, const char* unit) {
  const auto v = text(name);
  if (!v) return fallback;
  char* end = nullptr;
  const long long n = std::strtoll(v->c_str(), &end, 10);
  if (*end != '\0' || n < lo || n > hi)
    throw EngineError(ErrorKind::Config, std::string(name) + " must be " + unit + " in " +
                                             std::to_string(lo) + ".." + std::to_string(hi) +
                                             ", got '" + *v + "'");
  return n;
}

// The index in `choices` of the variable's value; 0 (the first choice, the default) when unset.
inline std::size_t choice(const char* name, std::initializer_list<const char*> choices) {
  const auto v = text(name);
  if (!v) return 0;
  std::size_t i = 0;
  std::string names;
  for (const char* c : choices) {
    if (*v == c) return i;
    names += (i == 0 ? "" : i + 1 == choices.size() ? " or " : ", ") + std::string(c);
    ++i;
  }
  throw EngineError(ErrorKind::Config,
                    std::string(name) + " must be " + names + ", got '" + *v + "'");
}

}  // namespace strata::env
