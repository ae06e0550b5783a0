// Stub (Linux host check): an opaque IOSurface handle.
#pragma once
typedef struct __IOSurface* IOSurfaceRef;
