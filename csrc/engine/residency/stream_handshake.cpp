// The handshake's host points (docs/architecture.md section 2): at_layer, finish_layer and their pieces.
#include "residency/expert_stream.h"

#include <algorithm>
#include <string>
#include <vector>

#include "common/check.h"
#include "residency/smap.h"

namespace strata {

std::uint32_t ExpertStream::publish(std::uint32_t layer) {
  check_layer(layer);
  std::lock_guard<std::mutex> lk(mu_);
  require_open();
  return publish_locked(layer);
}

std::uint32_t ExpertStream::publish_locked(std::uint32_t layer) {
  if (!opt_.publish_prefetch) return 0;
  const PackLayout& L = layout();
  const std::uint32_t first = (layer + 1) * L.n_experts;
  // I10: the last two layers scan only what exists.
  const std::uint32_t last = std::min<std::uint32_t>((layer + 3) * L.n_experts, L.n_keys());
  std::uint32_t n = 0;
  const std::uint32_t* smap = smap_.get();
  for (std::uint32_t key = first; key < last; ++key) {  // I2: <= 2 * n_experts entries
    // Published already (smap mirrors `published`: I1): most resident keys are, and the smap
    // is one contiguous row where each slot is a cache line of its own.
    if (smap_load(smap, key) != kAbsent) continue;
    std::int32_t s = where_[key];
    if (s < 0) continue;
    Slot& sl = slots_[std::uint32_t(s)];
    if (sl.published || sl.load() != SlotState::Complete) continue;
    publish_slot(std::uint32_t(s));
    ++n;
  }
  stats_.published.fetch_add(n, std::memory_order_relaxed);
  return n;
}

void ExpertStream::enter_layer(ClientId who, std::uint32_t layer) {
  check_layer(layer);
  {
    std::lock_guard<std::mutex> lk(mu_);
    enter_layer_locked(client_locked(who), layer, true, nullptr, 0);
  }
  done_cv_.notify_all();  // the previous layer's protections may have made room
}

void ExpertStream::enter_layer(ClientId who, std::uint32_t layer, const std::int32_t* experts,
                               std::size_t n) {
  check_layer(layer);
  {
    std::lock_guard<std::mutex> lk(mu_);
    enter_layer_locked(client_locked(who), layer, false, experts, n);
  }
  done_cv_.notify_all();  // the previous layer's protections may have made room
}

void ExpertStream::enter_layer_locked(ProtectionSet& p, std::uint32_t layer, bool whole_layer,
                                      const std::int32_t* experts, std::size_t n, bool keep) {
  const std::uint32_t E = layout().n_experts;
  STRATA_ASSERT(whole_layer || experts || n == 0, "an expert list of n > 0 needs its pointer");
  // Only the layer being executed has protections to keep: anything else is a caller's
  // ordering mistake, refused before it changes anything.
  if (keep && std::int64_t(layer) != p.executing)
    throw EngineError(ErrorKind::Turn, "keep_executing at layer " + std::to_string(layer) +
                                           ", which this client is not executing");
  if (!keep) p.executing_keep.assign(E, whole_layer ? 1 : 0);
  p.executing = layer;
  for (std::size_t i = 0; !whole_layer && i < n; ++i)
    if (experts[i] >= 0 && std::uint32_t(experts[i]) < E)
      p.executing_keep[std::uint32_t(experts[i])] = 1;
  p.next = -1;
}

void ExpertStream::after_layer(ClientId who, std::uint32_t layer) {
  check_layer(layer);
  std::lock_guard<std::mutex> lk(mu_);
  after_layer_locked(client_locked(who), layer);
}

void ExpertStream::after_layer_locked(ProtectionSet& p, std::uint32_t layer) {
  if (p.executing != layer) p.executing_keep.assign(layout().n_experts, 1);
  p.executing = layer;
  // After the last layer the next router to run is the next token's layer 0.
  p.next = layer + 1 < layout().n_layers ? layer + 1 : 0;
}

void ExpertStream::end_turn(ClientId who) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    ProtectionSet& p = client_locked(who);
    p.executing = -1;
    p.next = -1;
  }
  done_cv_.notify_all();
}

void ExpertStream::plan(ClientId who, std::uint32_t layer, const std::int32_t* experts,
                        std::size_t n, std::uint8_t* resident) {
  std::vector<std::uint32_t> slots(n);
  plan_slots(who, layer, experts, n, slots.data(), true);
  for (std::size_t i = 0; i < n; ++i) resident[i] = slots[i] != kAbsent;
}

void ExpertStream::plan_slots(ClientId who, std::uint32_t layer, const std::int32_t* experts,
                              std::size_t n, std::uint32_t* slots, bool pin) {
  check_experts(layer, experts, n);  // before any pin, so a bad id leaves no partial plan
  const std::uint32_t E = layout().n_experts;
  std::lock_guard<std::mutex> lk(mu_);
  require_open();
  ProtectionSet& p = client_locked(who);
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint32_t s = smap_load(smap_.get(), layer * E + std::uint32_t(experts[i]));
    slots[i] = s;
    if (pin && s != kAbsent) {
      ++slots_[s].pins;
      p.pinned.push_back(s);
    }
  }
}

void ExpertStream::release_plan(ClientId who) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    release_plan_locked(client_locked(who));
  }
  done_cv_.notify_all();
}

void ExpertStream::release_plan_locked(ProtectionSet& p) {
  for (std::uint32_t s : p.pinned) {
    STRATA_ASSERT(slots_[s].pins > 0, "pin count underflow");
    --slots_[s].pins;
  }
  p.pinned.clear();
}

// ---- the two host points of a layer, each under one lock hold -------------------------------

AtLayerResult ExpertStream::at_layer(ClientId who, const HandshakeRequest& q,
                                     const InterruptCheck& interrupt) {
  check_experts(q.layer, q.urgent, q.n_urgent);
  IoWaker waker{this};
  Lock lk(mu_);
  require_open();
  AtLayerResult r;
  enter_layer_locked(client_locked(who), q.layer, false, q.urgent, q.n_urgent,  // I4
                     q.keep_executing);
  done_cv_.notify_all();  // the previous layer's protections may have made room for others
  r.urgent = request_locked(lk, who, q.layer, q.urgent, q.n_urgent, ReadClass::Urgent, interrupt);
  if (q.publish) r.published = publish_locked(q.layer);  // I2: before the device is released
  // Speculation behind the urgent reads, one budget for every class, in queue order.
  std::uint32_t budget = q.spec_budget;
  auto speculate = [&](std::uint32_t distance, const std::int32_t* experts, std::size_t n,
                       ReadClass cls, std::uint32_t cap) {
    RequestResult out;
    if (n == 0 || budget == 0 || q.layer + distance >= layout().n_layers) return out;  // I10
    out = request_locked(lk, who, q.layer + distance, experts, n, cls, interrupt,
                         std::min(budget, cap));
    if (budget != kUnlimitedReads) budget -= std::min(budget, out.spec_started);
    return out;
  };
  r.predicted = speculate(1, q.next_layer, q.n_next_layer, ReadClass::Pred1, kUnlimitedReads);
  r.predicted2 = speculate(2, q.two_layer, q.n_two_layer, ReadClass::Pred2, q.two_layer_max);
  r.profile = speculate(1, q.profile, q.n_profile, ReadClass::Profile, kUnlimitedReads);
  return r;
}

void ExpertStream::finish_layer(ClientId who, std::uint32_t layer, const std::int32_t* chosen,
                                std::size_t n) {
  check_layer(layer);
  std::lock_guard<std::mutex> lk(mu_);
  require_open();
  after_layer_locked(client_locked(who), layer);  // I4: layer+1's router may run now
  retire_locked(layer, chosen, n);  // I7
  release_limbo_locked();
}

}  // namespace strata
