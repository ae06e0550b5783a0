// Stub (Linux host check): metal-cpp tests TARGET_OS_OSX to pick the macOS API surface.
#pragma once
#define TARGET_OS_OSX 1
#define TARGET_OS_IPHONE 0
