// The Window's scratch buffers (exec/scratch.h) are allocated unset; checked builds poison them
// so that a read before a write shows: NaN floats (they spread through every sum they enter)
// and integers no expert id or slot can be.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>

#include "exec/scratch.h"

using strata::kChecked;
using strata::ScratchArray;

TEST_CASE("checked builds poison fresh scratch: NaN floats, impossible ids and slots") {
  if (!kChecked) return;  // release builds leave it unset (nothing to check)
  constexpr std::size_t n = 3000;  // past a page, so the fill covers more than one
  ScratchArray<float> f;
  ScratchArray<std::int32_t> ids;
  ScratchArray<std::uint32_t> slots;
  f.allocate(n);
  ids.allocate(n);
  slots.allocate(n);
  for (std::size_t i = 0; i < n; ++i) {
    REQUIRE(std::isnan(f[i]));
    REQUIRE(ids[i] < 0);  // no expert id
    REQUIRE(slots[i] == 0xA5A5A5A5u);  // not kAbsent, and no arena has that many slots
  }
  // A new allocation is poisoned again, whatever was written into the last one.
  f[0] = 1.0f;
  f.allocate(n);
  REQUIRE(std::isnan(f[0]));
}
