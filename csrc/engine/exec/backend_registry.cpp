#include "exec/backend_registry.h"

#include <algorithm>
#include <mutex>
#include <utility>

#include "common/errors.h"
#include "exec/backend_support.h"

namespace strata {
namespace {

std::unique_ptr<Backend> cpu_factory(const BackendOptions& o) { return make_cpu_backend(o.threads); }

struct Registry {
  std::mutex mu;
  std::vector<std::pair<std::string, BackendFactory>> entries;  // mu

  // The reference is always there; the others register themselves from the code that links
  // them (csrc/python/backends.cpp for the ones built into _core).
  Registry() { entries.emplace_back("cpu", &cpu_factory); }
};

Registry& registry() {
  static Registry r;
  return r;
}

bool valid_name(const std::string& name) {
  if (name.empty() || name == "auto") return false;
  return std::all_of(name.begin(), name.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_';
  });
}

std::string joined(const std::vector<std::string>& names) {
  std::string out;
  for (const std::string& n : names) out += (out.empty() ? "" : ", ") + n;
  return out;
}

// The first capability of `needs` that `b` lacks, as "why", or nullopt.
std::optional<std::string> lacks(const Backend& b, const std::vector<Capability>& needs) {
  for (const Capability& c : needs) {
    if (c.layout)
      if (auto why = experts_unsupported(b, *c.layout)) return why;
    if (auto why = b.unsupported(c)) return why;
  }
  return std::nullopt;
}

}  // namespace

void register_backend(const std::string& name, BackendFactory factory) {
  if (!valid_name(name))
    throw EngineError(ErrorKind::Config, "backend name '" + name +
                                             "' must be lower-case letters, digits or '_', "
                                             "and not 'auto'");
  if (!factory) throw EngineError(ErrorKind::Config, "backend '" + name + "' has no factory");
  Registry& r = registry();
  std::lock_guard<std::mutex> lk(r.mu);
  for (const auto& [n, f] : r.entries)
    if (n == name) {
      if (f == factory) return;
      throw EngineError(ErrorKind::Config, "backend '" + name + "' is already registered");
    }
  r.entries.emplace_back(name, factory);
}

std::vector<std::string> backend_names() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lk(r.mu);
  std::vector<std::string> out;
  for (const auto& e : r.entries) out.push_back(e.first);
  return out;
}

std::unique_ptr<Backend> make_backend(const std::string& name, const BackendOptions& options,
                                      const std::vector<Capability>& needs) {
  std::vector<std::pair<std::string, BackendFactory>> entries;
  {
    Registry& r = registry();
    std::lock_guard<std::mutex> lk(r.mu);
    entries = r.entries;
  }
  if (name == "auto") {
    for (const auto& [n, factory] : entries) {
      if (n == "cpu") continue;
      try {
        std::unique_ptr<Backend> b = factory(options);
        if (!lacks(*b, needs)) return b;
      } catch (const EngineError&) {  // no device, or a pack or flag it does not cover
      }
    }
    return cpu_factory(options);
  }
  for (const auto& [n, factory] : entries) {
    if (n != name) continue;
    std::unique_ptr<Backend> b = factory(options);
    if (auto why = lacks(*b, needs))
      throw EngineError(ErrorKind::Config, "backend '" + name + "': " + *why);
    return b;
  }
  std::vector<std::string> names;
  for (const auto& e : entries) names.push_back(e.first);
  std::string msg = "backend must be auto or one of this build's backends (" + joined(names) +
                    "), got '" + name + "'";
  if (name == "metal")
    msg += ": the Metal backend is built on macOS only";
  throw EngineError(ErrorKind::Config, msg);
}

}  // namespace strata
