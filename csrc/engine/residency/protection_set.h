// ProtectionSet: what one client of an ExpertStream keeps from eviction (docs/architecture.md
// section 4, I4 and I8). A client is a Window (one per sequence), or the stream itself for callers
// that drive the handshake through ExpertStream's own methods. Several Windows share one arena,
// so each owns its protections and victim() respects their union: one Window's enter_layer or
// end_turn can never drop what another Window's device is reading.
//
// Guarded by ExpertStream::mu_, like every other slot-table field.
#pragma once

#include <cstdint>
#include <vector>

namespace strata {

// A distinct type, so that a ClientId never converts to or from a layer or expert number.
enum class ClientId : std::uint32_t {};
// The stream's own set: used by the ExpertStream methods that take no ClientId.
constexpr ClientId kStreamClient{0};

struct ProtectionSet {
  std::int64_t executing = -1;       // the layer this client's device is executing
  std::vector<char> executing_keep;  // per expert of `executing`: protected (I4)
  std::int64_t next = -1;            // layer l+1 during this client's after-layer work (I4)
  std::vector<std::uint32_t> pinned;  // slots this client's current plan pinned (I8)
  // An urgent request of this client is blocked waiting for another client to release a slot.
  // Two clients that both wait can never release anything: the second one fails (ArenaFull).
  bool waiting_for_space = false;

  bool holds_any() const { return executing >= 0 || next >= 0 || !pinned.empty(); }
};

}  // namespace strata
