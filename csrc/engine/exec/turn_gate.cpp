#include "exec/turn_gate.h"

#include <string>

#include "common/errors.h"

namespace strata {

TurnGate::Call::Call(TurnGate& gate, bool closed_ok) : gate_(gate) {
  std::lock_guard<std::mutex> lk(gate_.mu_);
  if (gate_.life_ != Life::Open) {
    if (closed_ok) return;
    throw EngineError(ErrorKind::Closed, "Window is closed");
  }
  const auto self = std::this_thread::get_id();
  if (gate_.turn_ != Kind::None && gate_.owner_ != self)
    throw EngineError(ErrorKind::Turn,
                      "this Window's turn belongs to another thread (two threads cannot drive "
                      "one Window; use one Window per thread or sequence)");
  if (gate_.busy_)
    throw EngineError(ErrorKind::Turn, "Window called from two threads at once; use one per thread");
  gate_.busy_ = true;
  gate_.busy_thread_ = self;
  admitted_ = true;
}

TurnGate::Call::~Call() {
  if (!admitted_) return;
  {
    std::lock_guard<std::mutex> lk(gate_.mu_);
    gate_.busy_ = false;
    gate_.busy_thread_ = {};
  }
  gate_.cv_.notify_all();
}

bool TurnGate::closed() const {
  std::lock_guard<std::mutex> lk(mu_);
  return life_ != Life::Open;
}

bool TurnGate::in_turn() const {
  std::lock_guard<std::mutex> lk(mu_);
  return turn_ != Kind::None;
}

std::uint32_t TurnGate::next_layer() const {
  std::lock_guard<std::mutex> lk(mu_);
  return next_layer_;
}

TurnGate::Entry TurnGate::enter(std::uint32_t layer, std::uint32_t rows, bool pass) {
  std::lock_guard<std::mutex> lk(mu_);
  if (turn_ == Kind::None) {
    if (layer != 0)
      throw EngineError(ErrorKind::Turn, "layer " + std::to_string(layer) +
                                             " called outside a turn: a turn starts at layer 0");
    if (rows == 0 && !pass) return Entry::Skip;
    turn_ = Kind::Implicit;  // ends after layer L-1
    owner_ = std::this_thread::get_id();
    next_layer_ = 0;
    return Entry::Opens;
  }
  if (layer != next_layer_)
    throw EngineError(ErrorKind::Turn, "layer " + std::to_string(layer) +
                                           " called out of order: this turn expects layer " +
                                           std::to_string(next_layer_) + " next");
  return rows == 0 && !pass ? Entry::Skip : Entry::Continue;
}

bool TurnGate::advance(std::uint32_t layer, std::uint32_t n_layers) {
  std::lock_guard<std::mutex> lk(mu_);
  next_layer_ = (layer + 1) % n_layers;
  return turn_ == Kind::Implicit && layer + 1 == n_layers;
}

bool TurnGate::implicit_open() const {
  std::lock_guard<std::mutex> lk(mu_);
  if (turn_ == Kind::Explicit) throw EngineError(ErrorKind::Turn, "a turn is already open");
  return turn_ == Kind::Implicit;  // this thread's (the Call checked the owner)
}

void TurnGate::open_explicit() {
  std::lock_guard<std::mutex> lk(mu_);
  turn_ = Kind::Explicit;
  owner_ = std::this_thread::get_id();
  next_layer_ = 0;
}

void TurnGate::close_turn() {
  std::lock_guard<std::mutex> lk(mu_);
  turn_ = Kind::None;
  owner_ = {};
  next_layer_ = 0;
}

bool TurnGate::begin_close() {
  std::unique_lock<std::mutex> lk(mu_);
  if (life_ == Life::Closed) return false;
  if (busy_ && busy_thread_ == std::this_thread::get_id())
    throw EngineError(ErrorKind::Turn, "Window.close() from inside one of its own calls");
  if (life_ == Life::Closing) {  // another thread is closing: wait until it is done
    cv_.wait(lk, [&] { return life_ == Life::Closed; });
    return false;
  }
  life_ = Life::Closing;                  // no call is admitted from now on
  cv_.wait(lk, [&] { return !busy_; });  // the layer in flight finishes (its own bounds)
  busy_ = true;
  busy_thread_ = std::this_thread::get_id();
  return true;
}

void TurnGate::finish_close() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    life_ = Life::Closed;
    turn_ = Kind::None;  // the owner's next call raises Closed
    owner_ = {};
    next_layer_ = 0;
    busy_ = false;
    busy_thread_ = {};
  }
  cv_.notify_all();
}

}  // namespace strata
