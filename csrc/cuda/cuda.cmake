# The CUDA backend: strata_stream._cuda, an extension module of its own (docs/cuda.md).
# STRATA_CUDA=AUTO builds it where nvcc is found, ON requires it, OFF skips it. The default
# builds are unchanged where there is no nvcc.
set(STRATA_CUDA "AUTO" CACHE STRING "Build the CUDA backend (strata_stream._cuda): AUTO, ON or OFF")
set_property(CACHE STRATA_CUDA PROPERTY STRINGS AUTO ON OFF)
# The CUDA tests' build (tests/cuda/device_run.sh): kernels that honour a planted error
# (STRATA_CUDA_TEST_PLANT at run time, kernels/device_types.h), so the parity tests can show they
# fail. Off, the release kernels carry no planted branch.
option(STRATA_CUDA_TEST_PLANT "Build the CUDA kernels with the tests' planted errors" OFF)

if(STRATA_SANITIZE AND STRATA_CUDA STREQUAL "AUTO")
  # The sanitizer builds test the engine; their -fsanitize flags are not nvcc's.
  message(STATUS "strata-stream: no CUDA backend in a sanitizer build (STRATA_CUDA=AUTO)")
  set(STRATA_CUDA "OFF")
endif()

if(NOT STRATA_CUDA STREQUAL "OFF")
  if(NOT CMAKE_CUDA_COMPILER AND NOT DEFINED ENV{CUDACXX})
    # nvcc off the PATH, where the toolkit installs it.
    file(GLOB _strata_cuda_roots /usr/local/cuda/bin /usr/local/cuda-*/bin)
    find_program(STRATA_NVCC nvcc HINTS ${_strata_cuda_roots})
    if(STRATA_NVCC)
      set(CMAKE_CUDA_COMPILER "${STRATA_NVCC}" CACHE FILEPATH "nvcc" FORCE)
    endif()
  endif()
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      # Hopper machine code plus its PTX, which later GPUs' drivers compile.
      set(CMAKE_CUDA_ARCHITECTURES 90)
    endif()
    enable_language(CUDA)
    # The static CUDA runtime beside nvcc (a toolkit, or PyPI's nvidia-cuda-* wheels, which have
    # no libcudart.so for FindCUDAToolkit): _cuda then needs only the driver, at run time.
    find_library(STRATA_CUDART_STATIC cudart_static
                 HINTS ${CMAKE_CUDA_IMPLICIT_LINK_DIRECTORIES} REQUIRED)
    message(STATUS "strata-stream: building the CUDA backend with ${CMAKE_CUDA_COMPILER}")
  elseif(STRATA_CUDA STREQUAL "ON")
    message(FATAL_ERROR "STRATA_CUDA=ON but no CUDA compiler (nvcc) was found; set CUDACXX")
  else()
    message(STATUS "strata-stream: no nvcc, so no CUDA backend (STRATA_CUDA=AUTO)")
  endif()
endif()

if(CMAKE_CUDA_COMPILER AND NOT STRATA_CUDA STREQUAL "OFF")
  # Kernels and host in one static library with hidden symbols: _cuda exports only its module
  # init, and shares with _core nothing but header-only engine types (host/factory.h).
  # The bf16 kernels on Hopper's wgmma (the default's prompt waves there; STRATA_CUDA_BF16) exist
  # in sm_90a machine code alone, whatever the rest is built for: elsewhere the default takes
  # mma.sync and STRATA_CUDA_BF16=wgmma is refused by name.
  add_library(strata_cuda_wgmma OBJECT csrc/cuda/kernels/wgmma_experts.cu)
  add_library(strata_cuda STATIC
    csrc/cuda/kernels/route.cu
    csrc/cuda/kernels/experts.cu
    csrc/cuda/kernels/mma_experts.cu
    csrc/cuda/host/cuda_backend.cpp
    csrc/cuda/host/arena_mirror.cpp
    csrc/cuda/host/bf16_families.cpp
    csrc/cuda/host/host_registry.cpp
    $<TARGET_OBJECTS:strata_cuda_wgmma>
  )
  foreach(target strata_cuda_wgmma strata_cuda)
    set_target_properties(${target} PROPERTIES
      CUDA_STANDARD 20 CUDA_STANDARD_REQUIRED ON
      CXX_VISIBILITY_PRESET hidden CUDA_VISIBILITY_PRESET hidden VISIBILITY_INLINES_HIDDEN ON
      CUDA_RUNTIME_LIBRARY Static)
  endforeach()
  set_target_properties(strata_cuda_wgmma PROPERTIES CUDA_ARCHITECTURES 90a)
  if(STRATA_CUDA_TEST_PLANT)
    target_compile_definitions(strata_cuda_wgmma PRIVATE STRATA_CUDA_PLANT=1)
    target_compile_definitions(strata_cuda PRIVATE STRATA_CUDA_PLANT=1)
  endif()
  target_include_directories(strata_cuda_wgmma PRIVATE csrc/cuda csrc/engine)
  target_include_directories(strata_cuda_wgmma SYSTEM PRIVATE
                             ${CMAKE_CUDA_TOOLKIT_INCLUDE_DIRECTORIES})
  target_include_directories(strata_cuda PUBLIC csrc/cuda csrc/engine)
  target_include_directories(strata_cuda SYSTEM PUBLIC ${CMAKE_CUDA_TOOLKIT_INCLUDE_DIRECTORIES})
  target_link_libraries(strata_cuda PUBLIC ${STRATA_CUDART_STATIC} Threads::Threads
                        ${CMAKE_DL_LIBS} $<$<PLATFORM_ID:Linux>:rt>)
  if(CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
    target_compile_options(strata_cuda PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra>)
  endif()
  # The backend driven directly, against the CPU backend (tests/cuda/device_run.sh runs it).
  add_executable(strata_cuda_check tests/cuda/backend_check.cpp)
  target_link_libraries(strata_cuda_check PRIVATE strata_cuda strata_engine)
  set_target_properties(strata_cuda_check PROPERTIES CUDA_RUNTIME_LIBRARY Static)
  if(STRATA_BUILD_PYTHON)
    pybind11_add_module(_cuda csrc/cuda/python/module.cpp)
    target_link_libraries(_cuda PRIVATE strata_cuda)
    set_target_properties(_cuda PROPERTIES CUDA_RUNTIME_LIBRARY Static)
    strata_private_runtime(_cuda)  # CMakeLists.txt: exports PyInit__cuda alone
    install(TARGETS _cuda DESTINATION strata_stream)
  endif()
endif()
