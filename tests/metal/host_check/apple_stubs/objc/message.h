// Stub (Linux host check): message sends. metal-cpp casts objc_msgSend to each method's type.
#pragma once
#include "runtime.h"
extern "C" {
void objc_msgSend(void);
void objc_msgSend_fpret(void);
void objc_msgSend_stret(void);
}
