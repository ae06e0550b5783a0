// Completion: a Window's kernels after its call returned (docs/architecture.md section 2, "The
// pending completion").
//
// A layer's protections (the executing layer's experts, I4; layer l+1's, the next router's) end
// only at the next at_layer, enter_layer, end_turn or release_client of the Window's client, so a
// call that returns with its kernels queued (its chunk's done Signal queued: chunk_plan.h) leaves
// them standing, and nothing of the Window may drop them until the backend drained. The states
// and their transitions, each named by its function:
//
//   Done -> ChunkPending          defer_chunk(): a chunk returned with its kernels queued; the
//                                 call's next host point keeps its experts protected beside its
//                                 own, or drains first (Window::keep_queued_chunk);
//   ChunkPending -> LayerPending  defer_layer(): the call returned with its kernels queued;
//   LayerPending -> TurnEndPending  defer_turn_end(): that call was the implicit turn's last
//                                 layer; the Window's turn is over, the stream's end_turn waits;
//   * -> Done                     drained(): Backend::synchronize() returned (every kernel done);
//                                 the caller settles what the returned state still owes (a
//                                 deferred turn end reaches the stream).
//
// Threads: only the Window's driving call (TurnGate's busy holder) moves the state; any thread
// may read pending() (an atomic), which is all Window::completion_pending() needs.
#pragma once

#include <atomic>
#include <cstdint>
#include <utility>

#include "common/check.h"

namespace strata {

class Completion {
 public:
  enum class State : std::uint8_t { Done, ChunkPending, LayerPending, TurnEndPending };

  // Any thread.
  bool pending() const { return state() != State::Done; }
  State state() const { return state_.load(std::memory_order_acquire); }

  // The driving call's transitions.
  void defer_chunk() {
    STRATA_ASSERT(state() == State::Done || state() == State::ChunkPending,
                  "only the call in progress has queued chunks");
    set(State::ChunkPending);
  }
  void defer_layer() {
    STRATA_ASSERT(state() == State::ChunkPending, "a queued call's last chunk is queued");
    set(State::LayerPending);
  }
  // prompt: the ended turn ran prompt waves, so its scratch goes back at the retire.
  void defer_turn_end(bool prompt) {
    STRATA_ASSERT(state() == State::LayerPending, "only a pending layer defers the turn end");
    turn_prompt_ = prompt;
    set(State::TurnEndPending);
  }
  // After Backend::synchronize(): nothing is pending any more. Returns what was.
  State drained() {
    const State was = state_.exchange(State::Done, std::memory_order_acq_rel);
    STRATA_ASSERT(was == State::TurnEndPending || !turn_prompt_,
                  "only a deferred turn end owes a prompt scratch");
    return was;
  }
  // A deferred turn end's prompt flag, taken by whoever ends that turn in the stream (and
  // cleared by an abandon or a teardown that ends it otherwise).
  bool take_turn_prompt() { return std::exchange(turn_prompt_, false); }

 private:
  void set(State s) { state_.store(s, std::memory_order_release); }

  std::atomic<State> state_{State::Done};  // written by the driving call only
  bool turn_prompt_ = false;               // the driving call's
};

}  // namespace strata
