# The Metal backend (csrc/metal/), included from the top-level CMakeLists.txt (include()).
#   macOS: kernels -> strata_kernels.metallib (xcrun metal -Wmetal-addr-spaces -fno-fast-math,
#          xcrun metallib), installed beside the extension; the host (metal-cpp, no Objective-C)
#          as the static library strata_metal, defining STRATA_HAVE_METAL.
#   Linux: nothing, unless STRATA_METAL_HOST_CHECK=ON (clang): the host compiled and linked
#          against the real metal-cpp headers with stub system headers, as the executable
#          strata_metal_host_check, which must report "no Metal device". Its program and the
#          stubs are test equipment, in tests/metal/host_check/.
# metal-cpp is never committed: the headers come from the mlx-metal wheel (Apache-2.0),
# downloaded into the build directory, or from STRATA_METAL_CPP_DIR.
option(STRATA_METAL_HOST_CHECK "Linux: compile and link the Metal host against metal-cpp" OFF)
set(STRATA_METAL_CPP_DIR "" CACHE PATH "metal-cpp headers (default: fetched into the build dir)")
set(STRATA_MLX_METAL_VERSION "0.32.4" CACHE STRING "mlx-metal wheel that provides metal-cpp")

set(STRATA_METAL_DIR ${CMAKE_CURRENT_LIST_DIR})
file(GLOB STRATA_METAL_KERNELS CONFIGURE_DEPENDS ${STRATA_METAL_DIR}/kernels/*.metal)
file(GLOB STRATA_METAL_KERNEL_HEADERS CONFIGURE_DEPENDS ${STRATA_METAL_DIR}/kernels/*.h)

function(strata_metal_cpp out)
  if(STRATA_METAL_CPP_DIR)
    set(${out} ${STRATA_METAL_CPP_DIR} PARENT_SCOPE)
    return()
  endif()
  set(dir ${CMAKE_BINARY_DIR}/metal-cpp)
  set(headers ${dir}/mlx/include/metal_cpp)
  if(NOT EXISTS ${headers}/Metal/Metal.hpp)
    find_package(Python COMPONENTS Interpreter REQUIRED)
    message(STATUS "strata-stream: fetching metal-cpp from mlx-metal ${STRATA_MLX_METAL_VERSION}")
    execute_process(
      COMMAND ${Python_EXECUTABLE} -m pip download --no-deps --only-binary=:all:
              --platform macosx_15_0_arm64 mlx-metal==${STRATA_MLX_METAL_VERSION} -d ${dir}/wheel
      RESULT_VARIABLE rc OUTPUT_QUIET)
    file(GLOB wheel ${dir}/wheel/mlx_metal-*.whl)
    if(NOT rc EQUAL 0 OR NOT wheel)
      message(FATAL_ERROR "cannot download mlx-metal (for metal-cpp); set STRATA_METAL_CPP_DIR")
    endif()
    file(ARCHIVE_EXTRACT INPUT ${wheel} DESTINATION ${dir} PATTERNS "mlx/include/metal_cpp/*")
  endif()
  set(${out} ${headers} PARENT_SCOPE)
endfunction()

# The embedded kernel source (newLibraryWithSource fallback).
set(STRATA_METAL_EMBEDDED ${CMAKE_BINARY_DIR}/strata_metal_kernel_source.cpp)
add_custom_command(
  OUTPUT ${STRATA_METAL_EMBEDDED}
  COMMAND ${CMAKE_COMMAND} -DOUT=${STRATA_METAL_EMBEDDED} -DKERNELS=${STRATA_METAL_DIR}/kernels
          -P ${STRATA_METAL_DIR}/embed_kernels.cmake
  DEPENDS ${STRATA_METAL_KERNELS} ${STRATA_METAL_KERNEL_HEADERS}
          ${STRATA_METAL_DIR}/embed_kernels.cmake
  COMMENT "Embedding the Metal kernel source")

set(STRATA_METAL_HOST_SOURCES
  ${STRATA_METAL_DIR}/host/metal_backend.cpp
  ${STRATA_METAL_DIR}/host/event_bridge.cpp
  ${STRATA_METAL_DIR}/host/kernel_library.cpp
  ${STRATA_METAL_DIR}/host/dispatch_plan.cpp
  ${STRATA_METAL_DIR}/host/metal_cpp_impl.cpp
  ${STRATA_METAL_EMBEDDED})

if(APPLE)
  strata_metal_cpp(metal_cpp)
  set(air_files "")
  foreach(src IN LISTS STRATA_METAL_KERNELS)
    get_filename_component(stem ${src} NAME_WE)
    set(air ${CMAKE_BINARY_DIR}/metal/${stem}.air)
    add_custom_command(
      OUTPUT ${air}
      COMMAND ${CMAKE_COMMAND} -E make_directory ${CMAKE_BINARY_DIR}/metal
      COMMAND xcrun -sdk macosx metal -c -Wmetal-addr-spaces -fno-fast-math
              -I ${STRATA_METAL_DIR}/kernels ${src} -o ${air}
      DEPENDS ${src} ${STRATA_METAL_KERNEL_HEADERS}
      COMMENT "xcrun metal ${stem}.metal")
    list(APPEND air_files ${air})
  endforeach()
  set(STRATA_METALLIB ${CMAKE_BINARY_DIR}/strata_kernels.metallib)
  add_custom_command(OUTPUT ${STRATA_METALLIB}
    COMMAND xcrun -sdk macosx metallib ${air_files} -o ${STRATA_METALLIB}
    DEPENDS ${air_files} COMMENT "xcrun metallib strata_kernels.metallib")
  add_custom_target(strata_metallib ALL DEPENDS ${STRATA_METALLIB})

  add_library(strata_metal STATIC ${STRATA_METAL_HOST_SOURCES})
  add_dependencies(strata_metal strata_metallib)
  target_include_directories(strata_metal PUBLIC ${STRATA_METAL_DIR}/host PRIVATE ${metal_cpp})
  target_link_libraries(strata_metal PUBLIC strata_engine "-framework Metal"
                        "-framework Foundation")
  target_compile_definitions(strata_metal PUBLIC STRATA_HAVE_METAL=1)
  if(STRATA_BUILD_PYTHON)
    # Found at run time beside the extension (kernel_library.cpp, dladdr).
    install(FILES ${STRATA_METALLIB} DESTINATION strata_stream)
  endif()
elseif(STRATA_METAL_HOST_CHECK)
  if(NOT CMAKE_CXX_COMPILER_ID MATCHES "Clang")
    message(FATAL_ERROR "STRATA_METAL_HOST_CHECK needs clang (-DCMAKE_CXX_COMPILER=clang++-19): "
                        "metal-cpp's headers use blocks, which GCC cannot parse")
  endif()
  strata_metal_cpp(metal_cpp)
  set(check_dir ${CMAKE_CURRENT_SOURCE_DIR}/tests/metal/host_check)
  add_executable(strata_metal_host_check ${STRATA_METAL_HOST_SOURCES}
    ${check_dir}/check_main.cpp ${check_dir}/check_runtime.cpp)
  target_include_directories(strata_metal_host_check PRIVATE ${STRATA_METAL_DIR}/host
    ${check_dir}/apple_stubs ${metal_cpp})
  target_compile_options(strata_metal_host_check PRIVATE -fblocks -include cmath -Wall -Wextra
    -Wno-unused-parameter)
  target_link_libraries(strata_metal_host_check PRIVATE strata_engine ${CMAKE_DL_LIBS})
endif()
