// Stub (Linux host check): the Objective-C runtime types metal-cpp names.
#pragma once
#include <cstdint>
typedef struct objc_class* Class;
typedef struct objc_selector* SEL;
typedef struct objc_object* id;
struct objc_object {
  Class isa;
};
typedef signed char BOOL;
typedef struct objc_object Protocol;
extern "C" {
SEL sel_registerName(const char* name);
id objc_lookUpClass(const char* name);
Protocol* objc_getProtocol(const char* name);
}
