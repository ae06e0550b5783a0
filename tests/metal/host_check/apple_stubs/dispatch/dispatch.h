// Stub (Linux host check): opaque libdispatch handles metal-cpp passes through.
#pragma once
typedef struct dispatch_queue_s* dispatch_queue_t;
typedef struct dispatch_data_s* dispatch_data_t;
