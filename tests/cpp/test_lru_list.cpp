// LruList against an independent oracle (std::list): the order a victim walk sees and the
// membership, after any mix of touches and removals.
#include <catch2/catch.hpp>

#include <algorithm>
#include <list>
#include <random>
#include <vector>

#include "residency/lru_list.h"

using strata::LruList;

namespace {

std::vector<std::uint32_t> walk(const LruList& l) {
  std::vector<std::uint32_t> out;
  for (std::uint32_t s = l.coldest(); s != LruList::kNone; s = l.warmer(s)) out.push_back(s);
  return out;
}

}  // namespace

TEST_CASE("LruList walks coldest first and matches a plain list under touches and removals",
          "[lru]") {
  constexpr std::uint32_t n = 37;
  LruList l(n);
  std::list<std::uint32_t> oracle;
  std::mt19937 rng(7);
  CHECK(l.coldest() == LruList::kNone);
  for (int step = 0; step < 20000; ++step) {
    const std::uint32_t s = rng() % n;
    oracle.remove(s);
    if (rng() % 3 != 0) {
      l.touch(s);
      oracle.push_back(s);
    } else {
      l.remove(s);
    }
    if (step % 61 == 0) {
      const std::vector<std::uint32_t> want(oracle.begin(), oracle.end());
      REQUIRE(walk(l) == want);
      for (std::uint32_t x = 0; x < n; ++x)
        REQUIRE(l.contains(x) == (std::find(want.begin(), want.end(), x) != want.end()));
    }
  }
  for (std::uint32_t x = 0; x < n; ++x) l.remove(x);
  CHECK(walk(l).empty());
  CHECK(l.coldest() == LruList::kNone);
}
