# cmake -DOUT=<file.cpp> -DKERNELS=<csrc/metal/kernels> -P embed_kernels.cmake
# The kernel source as one translation unit, for newLibraryWithSource when no metallib is
# found: the headers in dependency order, then every .metal file, local #includes and
# #pragma once removed (tests/metal/test_embedded_source.py type-checks the result).
set(headers params.h common.h formats.h matvec.h activation.h topk.h)
file(GLOB metal_files RELATIVE ${KERNELS} ${KERNELS}/*.metal)
list(SORT metal_files)
set(text "")
foreach(f IN LISTS headers metal_files)
  file(READ ${KERNELS}/${f} body)
  string(REGEX REPLACE "#include \"[^\"]*\"[^\n]*\n" "\n" body "${body}")
  string(REPLACE "#pragma once" "" body "${body}")
  string(APPEND text "// ---- ${f}\n${body}\n")
endforeach()
file(WRITE ${OUT}.tmp "// Generated from csrc/metal/kernels by embed_kernels.cmake; do not edit.\n"
  "extern \"C\" const char strata_metal_kernel_source[] = R\"STRATA_MSL(${text})STRATA_MSL\";\n")
file(RENAME ${OUT}.tmp ${OUT})
