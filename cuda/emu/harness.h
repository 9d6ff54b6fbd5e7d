// Glue for emulated launches: unpacks a CUDA-style `void** args` array into a kernel's
// parameters. A generated translation unit includes the kernel sources, then this file,
// then defines `emu_launch` with one `if` per instantiation it was built for
// (python/pagedkv/kernels/launchers.py writes it).
#pragma once

#include <cstddef>
#include <string>
#include <type_traits>
#include <utility>

namespace emu {

template <typename... Params, std::size_t... I>
void call_with_args(void (*kernel)(Params...), void** args, std::index_sequence<I...>) {
  kernel(*static_cast<std::remove_cv_t<std::remove_reference_t<Params>>*>(args[I])...);
}

template <typename... Params>
bool launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, std::size_t shared_bytes, void** args) {
  return launch(grid, block, shared_bytes, [&] { call_with_args(kernel, args, std::index_sequence_for<Params...>{}); });
}

}  // namespace emu
