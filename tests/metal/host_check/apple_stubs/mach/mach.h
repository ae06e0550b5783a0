// Stub (Linux host check): the Mach scalar types metal-cpp's MTLResource names.
#pragma once
#include <cstdint>
typedef int kern_return_t;
typedef unsigned int mach_port_t;
typedef mach_port_t task_id_token_t;
