// Invariant assertions. On in debug builds and the sanitizer test builds (STRATA_CHECKS=1); a
// failure aborts with the invariant's text, so a broken invariant is loud, never silent.
#pragma once

#include <cstdio>
#include <cstdlib>

#if !defined(NDEBUG) || (defined(STRATA_CHECKS) && STRATA_CHECKS)
#define STRATA_CHECKED 1
#else
#define STRATA_CHECKED 0
#endif

namespace strata {
// Whether this build checks its invariants (STRATA_ASSERT is live): for checks that are more
// than an assertion, such as poisoning fresh scratch (exec/scratch.h).
inline constexpr bool kChecked = STRATA_CHECKED != 0;
}  // namespace strata

#if STRATA_CHECKED
#define STRATA_ASSERT(cond, msg)                                                      \
  do {                                                                                \
    if (!(cond)) {                                                                    \
      std::fprintf(stderr, "strata invariant failed at %s:%d: %s (%s)\n", __FILE__,   \
                   __LINE__, msg, #cond);                                             \
      std::abort();                                                                   \
    }                                                                                 \
  } while (0)
#else
#define STRATA_ASSERT(cond, msg) ((void)0)
#endif
