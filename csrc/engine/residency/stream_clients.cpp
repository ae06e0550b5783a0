// The client registry: every Window registers one client and owns its protections (protection_set.h).
#include "residency/expert_stream.h"

#include <string>

#include "common/check.h"
#include "common/errors.h"

namespace strata {

ClientId ExpertStream::open_client(std::function<void()> on_close) {
  std::lock_guard<std::mutex> hooks(clients_mu_);
  std::lock_guard<std::mutex> lk(mu_);
  require_open();
  const ClientId id{next_client_++};
  clients_[id] = ProtectionSet{};
  closers_[id] = std::move(on_close);
  return id;
}

void ExpertStream::release_client(ClientId who) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = clients_.find(who);
    if (it == clients_.end()) return;
    release_plan_locked(it->second);
    it->second.executing = -1;
    it->second.next = -1;
  }
  done_cv_.notify_all();  // a request waiting for space may find some now
}

void ExpertStream::close_client(ClientId who) {
  STRATA_ASSERT(who != kStreamClient, "the stream's own protections are never unregistered");
  release_client(who);
  std::lock_guard<std::mutex> hooks(clients_mu_);
  closers_.erase(who);
  std::lock_guard<std::mutex> lk(mu_);
  clients_.erase(who);
}

std::size_t ExpertStream::n_clients() const {
  std::lock_guard<std::mutex> lk(mu_);
  return clients_.size() - 1;
}

std::size_t ExpertStream::clients_waiting_for_space() const {
  std::lock_guard<std::mutex> lk(mu_);
  std::size_t n = 0;
  for (const auto& [id, p] : clients_) n += p.waiting_for_space;
  return n;
}

ProtectionSet& ExpertStream::client_locked(ClientId who) {
  auto it = clients_.find(who);
  if (it == clients_.end())
    throw EngineError(ErrorKind::Closed, "stream client " + std::to_string(std::uint32_t(who)) +
                                             " is not registered (its Window was closed)");
  return it->second;
}

bool ExpertStream::another_client_may_release(ClientId who) const {
  for (const auto& [id, p] : clients_)
    if (id != who && p.holds_any() && !p.waiting_for_space) return true;
  return false;
}

}  // namespace strata
