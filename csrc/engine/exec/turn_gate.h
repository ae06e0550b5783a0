// TurnGate: who may drive a Window, and whose turn is open (docs/architecture.md section 2).
//
// A turn belongs to the thread that opened it: a call, begin_turn or end_turn from another thread
// while it is open raises EngineError(Turn). One driving call runs at a time: a Call admits it
// and marks the gate busy until it is destroyed, and the busy holder alone touches the Window's
// scratch, events and backend, so those need no lock. close() waits for the call in flight and
// then holds the gate itself while it tears down.
//
// Lock: every field below is under mu_; the waits are on cv_ (busy cleared, or closed).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>

namespace strata {

class TurnGate {
 public:
  // Admits one driving call on the turn owner's thread: throws Closed after close(), Turn when
  // another thread owns the turn or is inside a call. Releases the gate when destroyed.
  class Call {
   public:
    // closed_ok: report a closed gate by admitted() == false instead of throwing.
    explicit Call(TurnGate& gate, bool closed_ok = false);
    ~Call();
    Call(const Call&) = delete;
    Call& operator=(const Call&) = delete;
    bool admitted() const { return admitted_; }

   private:
    TurnGate& gate_;
    bool admitted_ = false;
  };

  // What a layer call finds (enter()).
  enum class Entry : std::uint8_t { Skip, Continue, Opens };

  // Any thread.
  bool closed() const;
  bool in_turn() const;
  std::uint32_t next_layer() const;

  // ---- the busy holder's (a Call's) ----
  // A layer call of `rows` rows at `layer`: Opens an implicit turn at layer 0 (rows > 0),
  // Continue in the open turn's order, Skip for an empty call. `pass`: the caller moves the turn
  // past a layer its pass does not run (Window::pass_layer), which opens and continues as a call
  // with rows does, never Skip. Throws Turn for a layer out of order or outside a turn.
  Entry enter(std::uint32_t layer, std::uint32_t rows, bool pass = false);
  // After layer `layer` of n_layers ran: whether that ended the implicit turn.
  bool advance(std::uint32_t layer, std::uint32_t n_layers);
  // begin_turn's check (Turn when an explicit turn is open): whether an implicit one is open.
  bool implicit_open() const;
  void open_explicit();
  void close_turn();  // no turn is open from here (the stream's end is the caller's)

  // ---- close ----
  // Marks the gate Closing, waits for the call in flight and holds the gate. False when it is
  // already closed (another thread's close finished, possibly waited for here). Turn error from
  // inside one of the Window's own calls.
  bool begin_close();
  void finish_close();  // Closed; the gate is free again (every later Call raises Closed)

 private:
  enum class Life : std::uint8_t { Open, Closing, Closed };
  enum class Kind : std::uint8_t { None, Explicit, Implicit };

  mutable std::mutex mu_;
  std::condition_variable cv_;  // busy_ cleared, or closed
  Life life_ = Life::Open;
  Kind turn_ = Kind::None;
  std::thread::id owner_;        // the thread whose turn is open
  bool busy_ = false;            // a driving call (or close) is running
  std::thread::id busy_thread_;  // which thread runs it
  std::uint32_t next_layer_ = 0;
};

}  // namespace strata
