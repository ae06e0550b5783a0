#include "exec/recorder.h"

#include <string>

#include "common/errors.h"

namespace strata {

LayerStats& LayerStats::operator+=(const LayerStats& o) {
  calls += o.calls;
  tokens += o.tokens;
  hits += o.hits;
  misses += o.misses;
  bytes_read += o.bytes_read;
  stall_ns += o.stall_ns;
  handshake_ns += o.handshake_ns;
  handshake_cpu_ns += o.handshake_cpu_ns;
  waves += o.waves;
  pred_correct += o.pred_correct;
  pred_predicted += o.pred_predicted;
  pred_actual += o.pred_actual;
  moce_moved += o.moce_moved;
  moce_changed += o.moce_changed;
  settle_ns += o.settle_ns;
  return *this;
}

Recorder::Recorder(const PackLayout& layout, bool record_routes)
    : n_layers_(layout.n_layers),
      n_experts_(layout.n_experts),
      top_k_(layout.top_k),
      record_routes_(record_routes),
      stats_(layout.n_layers),
      profile_(std::size_t(layout.n_layers) * layout.n_experts, 0),
      predicted_(layout.n_layers),
      actual_(layout.n_experts, 0) {}

std::vector<LayerStats> Recorder::layer_stats() const {
  std::lock_guard<std::mutex> lk(mu_);
  return stats_;
}

void Recorder::reset_stats() {
  std::lock_guard<std::mutex> lk(mu_);
  stats_.assign(n_layers_, LayerStats{});
}

std::vector<std::int32_t> Recorder::take_routes() {
  std::vector<std::int32_t> out;
  std::lock_guard<std::mutex> lk(mu_);
  out.swap(routes_);
  return out;
}

std::vector<std::uint32_t> Recorder::profile() const {
  std::lock_guard<std::mutex> lk(mu_);
  return profile_;
}

void Recorder::check_profile(const std::vector<std::uint32_t>& counts) const {
  const std::size_t want = std::size_t(n_layers_) * n_experts_;
  if (counts.size() != want)
    throw EngineError(ErrorKind::Config, "profile has " + std::to_string(counts.size()) +
                                             " counts, expected n_layers * n_experts = " +
                                             std::to_string(want));
}

void Recorder::set_profile(const std::vector<std::uint32_t>& counts) {
  std::lock_guard<std::mutex> lk(mu_);
  profile_ = counts;
}

std::vector<std::uint8_t> Recorder::route_resident() const {
  std::lock_guard<std::mutex> lk(mu_);
  return route_resident_;
}

std::int64_t Recorder::route_layer() const {
  std::lock_guard<std::mutex> lk(mu_);
  return route_layer_;
}

void Recorder::add_host_time(std::uint32_t layer, const HostTimer& t, const LayerStats& more) {
  const std::uint64_t wall = ns_since(t.wall), cpu = thread_cpu_ns() - t.cpu;
  add(layer, [&](LayerStats& s) {
    s += more;
    s.handshake_ns += wall;
    s.handshake_cpu_ns += cpu;
  });
}

void Recorder::begin_pass(std::uint32_t rows) {
  pass_first_token_ = tokens_seen_;
  tokens_seen_ += rows;
}

void Recorder::learn(std::uint32_t layer, std::uint32_t row0, const std::int32_t* ids,
                     std::uint32_t rows) {
  const std::uint32_t k = top_k_, n = rows * k;
  std::lock_guard<std::mutex> lk(mu_);
  std::uint32_t* counts = profile_.data() + std::size_t(layer) * n_experts_;
  for (std::uint32_t i = 0; i < n; ++i) ++counts[std::uint32_t(ids[i])];  // learned online
  if (!record_routes_) return;
  for (std::uint32_t i = 0; i < n; ++i)
    routes_.insert(routes_.end(), {std::int32_t(pass_first_token_ + row0 + i / k),
                                   std::int32_t(layer), ids[i]});
}

void Recorder::note_predicted(std::uint32_t next_layer, std::uint32_t chunk,
                              const std::vector<std::int32_t>& predicted) {
  auto& noted = predicted_[next_layer];
  if (noted.size() <= chunk) noted.resize(chunk + 1);
  noted[chunk].assign(predicted.begin(), predicted.end());
}

void Recorder::score_predicted(std::uint32_t layer, std::uint32_t chunk,
                               const std::vector<std::int32_t>& chosen, LayerStats& into) {
  auto& noted = predicted_[layer];
  if (chunk >= noted.size() || noted[chunk].empty()) return;
  for (std::int32_t e : chosen) actual_[std::uint32_t(e)] = 1;
  std::uint64_t correct = 0;
  for (std::int32_t e : noted[chunk]) correct += actual_[std::uint32_t(e)];
  for (std::int32_t e : chosen) actual_[std::uint32_t(e)] = 0;
  into.pred_correct += correct;
  into.pred_predicted += noted[chunk].size();
  into.pred_actual += chosen.size();
  noted[chunk].clear();
}

void Recorder::note_moce(std::uint32_t layer, std::uint32_t rows, const DeviceBuffers& b) {
  std::lock_guard<std::mutex> lk(mu_);
  LayerStats& st = stats_[layer];
  for (std::uint32_t t = 0; t < rows; ++t) {  // in row order: the same sum every run
    st.moce_moved += double(b.moce_moved[t]);
    st.moce_changed += b.moce_changed[t];
  }
  route_resident_.assign(b.route_resident, b.route_resident + n_experts_);
  route_layer_ = layer;
}

}  // namespace strata
