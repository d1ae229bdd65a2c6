// The CUDA execution model on the CPU: enough of it to run wrk's kernels (fixed.cu and the
// generated fused kernels) unchanged, compiled by the host C++ compiler.
//
// Two ways to run a launch, chosen per kernel by the host (see emulator/mod.rs):
//
// - A kernel that synchronises its block (`__syncthreads`, warp shuffles) or shares memory in
//   it (`__shared__`) runs its blocks one after another on one OS thread, each CUDA thread of the
//   block as a fiber with its own stack. A fiber runs until it reaches a barrier
//   (`__syncthreads`, a shuffle's exchange) or returns; the scheduler then runs the next fiber
//   that can go, and a barrier opens when every fiber of the block (or warp) that has not
//   returned has reached it, as on Volta and newer. `__shared__` variables are static, which is
//   per block because blocks run in turn (and one launch at a time per module). A block whose
//   fibers all wait at barriers that cannot open is a deadlock, reported as an error. Fibers
//   do not preempt each other, so a thread spinning on an atomic for a thread of its own block
//   would hang; wrk's synchronising kernels do not.
// - Any other kernel runs its blocks on a few OS threads at once, each block's CUDA threads one
//   after another, so threads of different blocks that wait on each other through atomics (the
//   group-by's slot claims) run concurrently, as on a GPU.
//
// Atomics are the compiler's sequentially consistent builtins. Not modelled: lock-step warps
// (code relying on implicit warp synchrony is wrong on Volta and is free to fail here), device
// memory spaces (all pointers are host pointers), and timing.

#pragma once

#define WRK_CUDA_EMULATOR 1

#include <math.h>
#include <string.h>

#include <setjmp.h>
#include <sys/mman.h>
#include <ucontext.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <memory>
#include <mutex>
#include <system_error>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#define __global__ __attribute__((used))
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(...)

struct wrk_emu_dim3 {
    unsigned x, y, z;
};

inline thread_local wrk_emu_dim3 threadIdx{0, 0, 0};
inline thread_local wrk_emu_dim3 blockIdx{0, 0, 0};
inline thread_local wrk_emu_dim3 blockDim{1, 1, 1};
inline thread_local wrk_emu_dim3 gridDim{1, 1, 1};
static const int warpSize = 32;

namespace wrk_emu {

// A barrier among fibers: the number of parties shrinks as fibers return from the kernel.
struct FiberBarrier {
    unsigned parties = 0;
    unsigned arrived = 0;
    unsigned long long generation = 0;

    void reset(unsigned n) {
        parties = n;
        arrived = 0;
    }

    // Counts an arrival; true when it opened the barrier (the caller need not wait).
    bool arrive() {
        if (++arrived >= parties) {
            open();
            return true;
        }
        return false;
    }

    void leave() {
        --parties;
        if (arrived > 0 && arrived >= parties) open();
    }

    void open() {
        arrived = 0;
        ++generation;
    }
};

struct Fiber {
    jmp_buf context;
    bool started = false;
    const FiberBarrier* waiting_on = nullptr;
    unsigned long long waiting_for = 0;  // the generation that releases it
    bool done = false;
};

// The launch being run in fiber mode (one at a time per module: see `launch_lock`).
struct FiberLaunch {
    void (*run_thread)(FiberLaunch*, unsigned) = nullptr;
    void* kernel = nullptr;
    void** args = nullptr;
    unsigned block_threads = 0;
    std::vector<Fiber> fibers;
    jmp_buf scheduler;
    unsigned current = 0;
    FiberBarrier threads;
    FiberBarrier warps[32];
    unsigned long long lanes[32][32];

    void start_block() {
        threads.reset(block_threads);
        for (unsigned w = 0; w < 32; ++w) {
            unsigned first = w * 32;
            warps[w].reset(first < block_threads ? std::min(block_threads - first, 32u) : 0);
        }
    }
};

inline FiberLaunch* current_launch = nullptr;
inline std::mutex launch_lock;

// Back to the scheduler until `barrier` reaches the generation after the current one.
inline void wait_at(FiberBarrier& barrier) {
    FiberLaunch& launch = *current_launch;
    Fiber& fiber = launch.fibers[launch.current];
    fiber.waiting_on = &barrier;
    fiber.waiting_for = barrier.generation + 1;
    if (barrier.arrive()) {
        fiber.waiting_on = nullptr;
        return;
    }
    if (!_setjmp(fiber.context)) _longjmp(launch.scheduler, 1);
}

// The body of fiber `t` (makecontext passes no pointer portably: the launch is global).
inline void fiber_entry() {
    FiberLaunch& launch = *current_launch;
    unsigned t = launch.current;
    launch.run_thread(&launch, t);
    launch.fibers[t].done = true;
    _longjmp(launch.scheduler, 1);
}

template <class T>
T shuffle(T value, int lane_offset, bool up) {
    static_assert(sizeof(T) <= 8, "shuffles move at most 8 bytes");
    FiberLaunch& launch = *current_launch;
    unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    unsigned long long bits = 0;
    memcpy(&bits, &value, sizeof(T));
    launch.lanes[warp][lane] = bits;
    wait_at(launch.warps[warp]);
    T out = value;
    long source = up ? (long)lane - lane_offset : (long)lane + lane_offset;
    if (source >= 0 && source < 32) memcpy(&out, &launch.lanes[warp][source], sizeof(T));
    wait_at(launch.warps[warp]);
    return out;
}

template <class... A, std::size_t... I>
void invoke(void (*kernel)(A...), void** args, std::index_sequence<I...>) {
    kernel(*static_cast<std::remove_cv_t<A>*>(args[I])...);
}

// Fiber `t`'s work: thread t of every block, with the barrier between blocks.
template <class... A>
void run_fiber_thread(FiberLaunch* launch, unsigned t) {
    auto kernel = reinterpret_cast<void (*)(A...)>(launch->kernel);
    for (unsigned b = 0; b < gridDim.x; ++b) {
        invoke(kernel, launch->args, std::index_sequence_for<A...>{});
        launch->threads.leave();
        launch->warps[t >> 5].leave();
        // Every fiber finishes block b before any starts block b + 1: the scheduler moves on
        // when all are parked here.
        launch->fibers[t].waiting_on = nullptr;
        launch->fibers[t].waiting_for = ~0ULL;
        if (!_setjmp(launch->fibers[t].context)) _longjmp(launch->scheduler, 1);
    }
}

constexpr std::size_t FIBER_STACK = 256 * 1024;

// Blocks in turn on this OS thread, a block's threads as fibers: for kernels that synchronise
// or share. Returns 0, -1 if the fibers' stacks could not be mapped, -3 on a deadlock.
template <class... A>
int launch_fibers(void (*kernel)(A...), void** args, unsigned grid, unsigned block_threads) {
    std::size_t stacks_len = FIBER_STACK * block_threads;
    void* stacks = mmap(nullptr, stacks_len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (stacks == MAP_FAILED) return -1;
    std::unique_ptr<FiberLaunch> launch(new FiberLaunch());
    launch->run_thread = &run_fiber_thread<A...>;
    launch->kernel = reinterpret_cast<void*>(kernel);
    launch->args = args;
    launch->block_threads = block_threads;
    launch->fibers.resize(block_threads);
    current_launch = launch.get();
    blockDim = {block_threads, 1, 1};
    gridDim = {grid, 1, 1};
    int status = 0;
    for (unsigned b = 0; b < grid && status == 0; ++b) {
        launch->start_block();
        for (auto& fiber : launch->fibers) {
            fiber.waiting_on = nullptr;
            fiber.waiting_for = 0;
        }
        blockIdx = {b, 0, 0};
        // Run fibers until every one is parked at the end of the block (or has returned).
        while (true) {
            bool ran = false, all_parked = true;
            for (unsigned t = 0; t < block_threads; ++t) {
                Fiber& fiber = launch->fibers[t];
                if (fiber.done) continue;
                bool parked = fiber.waiting_on == nullptr && fiber.waiting_for == ~0ULL;
                if (parked) continue;
                all_parked = false;
                if (fiber.waiting_on != nullptr && fiber.waiting_on->generation < fiber.waiting_for) continue;
                fiber.waiting_on = nullptr;
                launch->current = t;
                threadIdx = {t, 0, 0};
                ran = true;
                if (!_setjmp(launch->scheduler)) {
                    if (fiber.started) _longjmp(fiber.context, 1);
                    // First run: start the fiber on its own stack (it comes back by longjmp).
                    fiber.started = true;
                    ucontext_t context;
                    getcontext(&context);
                    context.uc_stack.ss_sp = static_cast<char*>(stacks) + FIBER_STACK * t;
                    context.uc_stack.ss_size = FIBER_STACK;
                    context.uc_link = nullptr;
                    makecontext(&context, fiber_entry, 0);
                    setcontext(&context);
                }
            }
            if (all_parked) break;
            if (!ran) {
                status = -3;
                break;
            }
        }
    }
    munmap(stacks, stacks_len);
    current_launch = nullptr;
    return status;
}
// Starts `count` OS threads running `body(index)` once all have started, so that a failure to
// start one of them calls them all off. Returns whether all started, after joining them.
template <class F>
bool run_threads(unsigned count, F body) {
    std::mutex gate;
    std::condition_variable opened;
    int state = 0;  // 0 waiting, 1 run, 2 called off
    std::vector<std::thread> threads;
    threads.reserve(count);
    bool started = true;
    try {
        for (unsigned t = 0; t < count; ++t) {
            threads.emplace_back([&, t] {
                {
                    std::unique_lock<std::mutex> lock(gate);
                    opened.wait(lock, [&] { return state != 0; });
                    if (state == 2) return;
                }
                body(t);
            });
        }
    } catch (const std::system_error&) {
        started = false;
    }
    {
        std::lock_guard<std::mutex> lock(gate);
        state = started ? 1 : 2;
    }
    opened.notify_all();
    for (auto& thread : threads) thread.join();
    return started;
}

// Blocks spread over a few OS threads, each block's threads in turn: for the other kernels.
template <class... A>
int launch_independent(void (*kernel)(A...), void** args, unsigned grid, unsigned block_threads) {
    std::atomic<unsigned> next_block{0};
    bool started = run_threads(std::min(grid, 4u), [&](unsigned) {
        blockDim = {block_threads, 1, 1};
        gridDim = {grid, 1, 1};
        for (unsigned b = next_block.fetch_add(1); b < grid; b = next_block.fetch_add(1)) {
            blockIdx = {b, 0, 0};
            for (unsigned t = 0; t < block_threads; ++t) {
                threadIdx = {t, 0, 0};
                invoke(kernel, args, std::index_sequence_for<A...>{});
            }
        }
    });
    return started ? 0 : -1;
}

// Runs `kernel` over `grid` blocks of `block_threads` threads; `args[i]` points at the i-th
// parameter's value, as `cuLaunchKernel` takes them. `synchronising` says whether the kernel
// uses `__syncthreads`, warp shuffles or `__shared__` memory. Returns 0; -1 if the threads or
// stacks could not be had, -2 for an invalid launch, -3 if a block deadlocked at a barrier.
template <class... A>
int launch(void (*kernel)(A...), void** args, unsigned grid, unsigned block_threads, bool synchronising) {
    if (grid == 0 || block_threads == 0 || block_threads > 1024) return -2;
    std::lock_guard<std::mutex> guard(launch_lock);
    return synchronising ? launch_fibers(kernel, args, grid, block_threads)
                         : launch_independent(kernel, args, grid, block_threads);
}

}  // namespace wrk_emu

inline void __syncthreads() { wrk_emu::wait_at(wrk_emu::current_launch->threads); }

template <class T>
T __shfl_up_sync(unsigned, T value, int delta) {
    return wrk_emu::shuffle(value, delta, true);
}

template <class T>
T __shfl_down_sync(unsigned, T value, int delta) {
    return wrk_emu::shuffle(value, delta, false);
}

inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }

inline long long __double_as_longlong(double v) {
    long long bits;
    memcpy(&bits, &v, 8);
    return bits;
}

inline double __longlong_as_double(long long bits) {
    double v;
    memcpy(&v, &bits, 8);
    return v;
}

template <class T, class U>
T atomicCAS(T* at, U expected, U desired) {
    T old = (T)expected;
    __atomic_compare_exchange_n(at, &old, (T)desired, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    return old;
}

template <class T, class U>
T atomicExch(T* at, U value) {
    return __atomic_exchange_n(at, (T)value, __ATOMIC_SEQ_CST);
}

// Integer adds are the builtin; floating adds loop on compare-and-swap of the value's bits.
template <class T, class U>
T atomicAdd(T* at, U value) {
    if constexpr (std::is_integral_v<T>) {
        return __atomic_fetch_add(at, (T)value, __ATOMIC_SEQ_CST);
    } else {
        using Bits = std::conditional_t<sizeof(T) == 8, unsigned long long, unsigned>;
        Bits* bits = reinterpret_cast<Bits*>(at);
        Bits old = __atomic_load_n(bits, __ATOMIC_SEQ_CST), next;
        T before;
        do {
            memcpy(&before, &old, sizeof(T));
            T sum = before + (T)value;
            memcpy(&next, &sum, sizeof(T));
        } while (!__atomic_compare_exchange_n(bits, &old, next, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST));
        return before;
    }
}

namespace wrk_emu {
// Stores `v` while `replaces(v, current)` holds; returns the value before.
template <class T, class F>
T store_if(T* at, T v, F replaces) {
    T old = __atomic_load_n(at, __ATOMIC_SEQ_CST);
    while (replaces(v, old) && !__atomic_compare_exchange_n(at, &old, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
    }
    return old;
}
}  // namespace wrk_emu

template <class T, class U>
T atomicMin(T* at, U value) {
    return wrk_emu::store_if(at, (T)value, [](T v, T old) { return v < old; });
}

template <class T, class U>
T atomicMax(T* at, U value) {
    return wrk_emu::store_if(at, (T)value, [](T v, T old) { return v > old; });
}

template <class T, class U>
T atomicOr(T* at, U value) {
    return __atomic_fetch_or(at, (T)value, __ATOMIC_SEQ_CST);
}

template <class T, class U>
T atomicAnd(T* at, U value) {
    return __atomic_fetch_and(at, (T)value, __ATOMIC_SEQ_CST);
}
