#include "exec/scratch.h"

#include <exception>
#include <string>

#include "common/errors.h"

namespace strata {

Scratch::Scratch(const ExpertStream& stream, const float* routers)
    : stream_(stream), L_(stream.layout()) {
  b_.layout = &L_;
  b_.arena = stream.arena().data();
  b_.slot_bytes = stream.arena().slot_bytes();
  b_.n_slots = stream.n_slots();
  b_.smap = stream.smap();
  b_.routers = routers;
}

bool Scratch::ensure(std::uint32_t rows) {
  if (rows <= rows_) return false;
  const std::size_t T = rows, k = L_.top_k, H = L_.hidden, I = L_.moe_intermediate,
                    E = L_.n_experts;
  x_.allocate(T * H);
  out_.allocate(T * H);
  ids_.allocate(T * k);
  weights_.allocate(T * k);
  pred_ids_[0].allocate(T * k);
  pred_ids_[1].allocate(T * k);
  logits_.allocate(T * E);
  plan_.allocate(T * k);
  h_.allocate(T * k * I);
  y_.allocate(T * k * H);
  wave_.allocate(E);
  wave_n_.allocate(1);
  moce_moved_.allocate(T);
  moce_changed_.allocate(T);
  route_resident_.allocate(E);
  rows_ = rows;
  bytes_ = 4 * (2 * T * H + 6 * T * k + T * E + T * k * I + T * k * H + E + 1 + 2 * T + E);
  b_.max_rows = rows;
  b_.x = x_.data();
  b_.ids = ids_.data();
  b_.weights = weights_.data();
  b_.pred_ids[0] = pred_ids_[0].data();
  b_.pred_ids[1] = pred_ids_[1].data();
  b_.logits = logits_.data();
  b_.plan = plan_.data();
  b_.h = h_.data();
  b_.y = y_.data();
  b_.out = out_.data();
  b_.wave = wave_.data();
  b_.wave_n = wave_n_.data();
  b_.moce_moved = moce_moved_.data();
  b_.moce_changed = moce_changed_.data();
  b_.route_resident = route_resident_.data();
  return true;
}

void Scratch::release() {
  for (auto* v : {&x_, &weights_, &logits_, &h_, &y_, &out_, &moce_moved_}) v->reset();
  for (auto* v : {&ids_, &pred_ids_[0], &pred_ids_[1], &wave_}) v->reset();
  for (auto* v : {&plan_, &wave_n_, &moce_changed_, &route_resident_}) v->reset();
  rows_ = 0;
  bytes_ = 0;
  bound_ = false;
}

void Scratch::release(Backend& backend) {
  backend.synchronize();  // no command may still read the buffers
  release();
}

void Scratch::bind(std::uint32_t rows, Backend& backend) {
  if (rows <= rows_ && bound_) return;
  backend.synchronize();  // nothing may run over the buffers being replaced
  bound_ = false;         // until the backend has the new ones
  ensure(rows);
  try {
    backend.bind(b_);
  } catch (const EngineError&) {
    throw;
  } catch (const std::exception& e) {
    throw EngineError(ErrorKind::Device,
                      "the " + backend.name() + " backend could not take its buffers for " +
                          std::to_string(rows_) + " rows: " + e.what());
  }
  bound_ = true;
}

}  // namespace strata
