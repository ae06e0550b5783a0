// Names the calling thread, so a debugger, `top -H`, a sanitizer report or a test reading
// /proc/self/task/*/comm can tell the engine's threads (IO, device, pool) from everyone else's.
#pragma once

#include <pthread.h>

#include <string>

namespace strata {

// Linux keeps 15 characters; longer names are cut, not refused.
inline void name_this_thread(const char* name) {
  std::string cut(name);
  if (cut.size() > 15) cut.resize(15);
#if defined(__APPLE__)
  pthread_setname_np(cut.c_str());  // Darwin names only the calling thread
#else
  pthread_setname_np(pthread_self(), cut.c_str());
#endif
}

}  // namespace strata
