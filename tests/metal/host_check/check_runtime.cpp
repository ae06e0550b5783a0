// Link-time stubs for the Linux host check (STRATA_METAL_HOST_CHECK): the Metal framework
// entry points and the Objective-C/blocks runtime symbols metal-cpp references. There is no
// device, so MTLCreateSystemDefaultDevice returns null; any message send would mean the host
// talked to a device that does not exist, so it aborts loudly instead of pretending.
#include <cstdio>
#include <cstdlib>

extern "C" {

void* MTLCreateSystemDefaultDevice() { return nullptr; }
void* MTLCopyAllDevicesWithObserver(void**, void*) { return nullptr; }
void MTLRemoveDeviceObserver(void*) {}

[[noreturn]] static void no_runtime(const char* what) {
  std::fprintf(stderr, "metal host check: %s called without an Objective-C runtime\n", what);
  std::abort();
}

void objc_msgSend() { no_runtime("objc_msgSend"); }
void objc_msgSend_fpret() { no_runtime("objc_msgSend_fpret"); }
void objc_msgSend_stret() { no_runtime("objc_msgSend_stret"); }
// Selector and class lookups run at static initialisation in metal-cpp's implementation unit:
// a distinct non-null token per call is all they need here.
void* sel_registerName(const char* name) { return const_cast<char*>(name); }
void* objc_lookUpClass(const char* name) { return const_cast<char*>(name); }
void* objc_getProtocol(const char* name) { return const_cast<char*>(name); }

void* _NSConcreteStackBlock[32];
void _Block_object_assign(void*, const void*, int) { no_runtime("_Block_object_assign"); }
void _Block_object_dispose(const void*, int) { no_runtime("_Block_object_dispose"); }
}
