// Stub (Linux host check): the CoreFoundation scalars metal-cpp uses.
#pragma once
#include <cstdint>
typedef double CFTimeInterval;
typedef const struct __CFString* CFStringRef;
typedef long CFIndex;
typedef unsigned long CFTypeID;
typedef const void* CFTypeRef;
