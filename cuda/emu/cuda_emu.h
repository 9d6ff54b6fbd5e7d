// A small CUDA emulator: enough of the CUDA C++ device API for pagedkv's kernels to compile
// as host C++ and run on the CPU, so their results are tested in CI without a GPU.
//
// A launch runs the CTAs one after another. The threads of a CTA are fibers on one OS thread
// (started with ucontext, then switched with _setjmp/_longjmp, which skip the signal-mask
// system calls of swapcontext): __syncthreads() and warp shuffles are barriers at which a fiber yields until
// every thread of its CTA (or warp) has arrived. A barrier that can never complete (threads
// of one CTA or warp reaching different barriers) stops the launch with an error instead of
// hanging. Dynamic shared memory is filled with NaN before each CTA, so a kernel that reads
// shared memory it never wrote produces NaN outputs.
#pragma once

#include <setjmp.h>
#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <type_traits>
#include <vector>

struct dim3 {
  unsigned int x = 1, y = 1, z = 1;
};

namespace emu {

struct Barrier {
  unsigned expected = 0, arrived = 0;
  unsigned long generation = 0;

  void arrive() {
    if (++arrived >= expected) release();
  }
  void leave() {  // a thread that exits no longer counts
    --expected;
    if (arrived && arrived >= expected) release();
  }
  void release() {
    arrived = 0;
    ++generation;
  }
};

struct Fiber {
  ucontext_t context;  // only to start the fiber on its stack
  jmp_buf resume;
  std::unique_ptr<char[]> stack;
  dim3 index;
  unsigned warp = 0;
  Barrier* waiting = nullptr;
  unsigned long waiting_generation = 0;
  bool started = false, finished = false;
};

struct Block {
  dim3 grid, block, block_index;
  std::vector<Fiber> fibers;
  Fiber* running = nullptr;
  ucontext_t scheduler_context;
  jmp_buf scheduler;
  Barrier cta;
  std::vector<Barrier> warps;
  std::vector<std::uint64_t> shuffle_slots;  // 32 per warp
  std::vector<float> shared_memory;
  std::function<void()> body;
};

inline Block* current = nullptr;
inline dim3 thread_index;
constexpr std::size_t STACK_BYTES = 64 * 1024;

inline float* dynamic_shared_memory() { return current->shared_memory.data(); }

inline void arrive_and_wait(Barrier& barrier) {
  Fiber* self = current->running;
  self->waiting = &barrier;
  self->waiting_generation = barrier.generation;
  barrier.arrive();
  if (!_setjmp(self->resume)) _longjmp(current->scheduler, 1);  // back here once released
}

template <typename T>
T shuffle_xor(T value, int lane_mask) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>);
  Fiber* self = current->running;
  const unsigned lane = (unsigned)(self - current->fibers.data()) % 32;
  std::uint64_t* slots = current->shuffle_slots.data() + self->warp * 32;
  std::uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof(T));
  slots[lane] = bits;
  arrive_and_wait(current->warps[self->warp]);
  bits = slots[lane ^ (unsigned)lane_mask];
  arrive_and_wait(current->warps[self->warp]);  // nobody overwrites a slot before it is read
  T result;
  std::memcpy(&result, &bits, sizeof(T));
  return result;
}

inline void fiber_main() {
  current->body();
  Fiber* self = current->running;
  self->finished = true;
  current->cta.leave();
  current->warps[self->warp].leave();
  _longjmp(current->scheduler, 1);  // never returns: the fiber's stack is simply dropped
}

// Runs one CTA to completion; false when its threads deadlocked at barriers.
inline bool run_block(Block& state) {
  const unsigned threads = (unsigned)state.fibers.size();
  state.cta = Barrier{threads};
  for (unsigned w = 0; w < state.warps.size(); ++w) state.warps[w] = Barrier{std::min(32u, threads - 32 * w)};
  for (unsigned t = 0; t < threads; ++t) {
    Fiber& fiber = state.fibers[t];
    fiber.waiting = nullptr;
    fiber.started = fiber.finished = false;
    getcontext(&fiber.context);
    fiber.context.uc_stack.ss_sp = fiber.stack.get();
    fiber.context.uc_stack.ss_size = STACK_BYTES;
    fiber.context.uc_link = nullptr;
    makecontext(&fiber.context, fiber_main, 0);
  }
  unsigned remaining = threads;
  while (remaining) {
    bool progress = false;
    for (Fiber& fiber : state.fibers) {
      if (fiber.finished || (fiber.waiting && fiber.waiting->generation == fiber.waiting_generation)) continue;
      fiber.waiting = nullptr;
      state.running = &fiber;
      thread_index = fiber.index;
      if (!_setjmp(state.scheduler)) {
        if (fiber.started) _longjmp(fiber.resume, 1);
        fiber.started = true;
        swapcontext(&state.scheduler_context, &fiber.context);
      }
      progress = true;
      if (fiber.finished) --remaining;
    }
    if (!progress) return false;
  }
  return true;
}

// Runs kernel() over the grid; false when a CTA deadlocked.
template <typename Kernel>
bool launch(dim3 grid, dim3 block, std::size_t shared_bytes, Kernel kernel) {
  const unsigned threads = block.x * block.y * block.z;
  Block state;
  state.grid = grid;
  state.block = block;
  state.body = kernel;
  state.fibers.resize(threads);
  for (unsigned t = 0; t < threads; ++t) {
    state.fibers[t].stack.reset(new char[STACK_BYTES]);
    state.fibers[t].index = {t % block.x, (t / block.x) % block.y, t / (block.x * block.y)};
    state.fibers[t].warp = t / 32;
  }
  state.warps.resize((threads + 31) / 32);
  state.shuffle_slots.assign(state.warps.size() * 32, 0);
  current = &state;
  bool ok = true;
  for (unsigned z = 0; z < grid.z && ok; ++z)
    for (unsigned y = 0; y < grid.y && ok; ++y)
      for (unsigned x = 0; x < grid.x && ok; ++x) {
        state.block_index = {x, y, z};
        state.shared_memory.assign(shared_bytes / sizeof(float) + 1, std::nanf(""));
        ok = run_block(state);
      }
  current = nullptr;
  return ok;
}

}  // namespace emu

#define __global__
#define __device__
#define __forceinline__ inline
#define threadIdx (emu::thread_index)
#define blockIdx (emu::current->block_index)
#define blockDim (emu::current->block)
#define gridDim (emu::current->grid)

inline void __syncthreads() { emu::arrive_and_wait(emu::current->cta); }
template <typename T>
T __shfl_xor_sync(unsigned, T value, int lane_mask) { return emu::shuffle_xor(value, lane_mask); }
inline float __expf(float x) { return std::exp(x); }
inline float __uint_as_float(unsigned int bits) { float f; std::memcpy(&f, &bits, 4); return f; }
inline float __int_as_float(int bits) { float f; std::memcpy(&f, &bits, 4); return f; }
inline unsigned int __float_as_uint(float f) { unsigned int bits; std::memcpy(&bits, &f, 4); return bits; }
using std::fmaxf;
using std::max;
using std::min;
