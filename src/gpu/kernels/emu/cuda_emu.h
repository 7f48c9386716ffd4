// A small SIMT emulator for running kernels/lz4.cu on a CPU, in one OS thread: each lane of a
// warp is a fiber (its own stack); at every warp intrinsic (__syncwarp, __ballot_sync,
// __shfl_sync, __match_any_sync) a lane publishes its value and yields to the next lane, so a
// collective completes once all 32 lanes have reached it. __shared__ arrays are statics (the
// warps of a block run one after the other; the kernels never use __syncthreads).
//
// It runs the CUDA C source itself, so tests/gpu_kernel_emu.rs can compare what the kernel
// source computes with the Rust model (src/gpu/model.rs) on machines without a GPU. It aborts
// when lanes of a warp reach different collectives, or some lanes a collective after others
// have returned: the kernels must call them in warp-uniform control flow, as FULL_MASK needs
// on hardware. It does not check the PTX, the compiler or memory ordering; the GPU tests do.
#pragma once

#include <csetjmp>
#include <cstdio>
#include <cstdlib>
#include <ucontext.h>

struct uint4 {
    unsigned int x, y, z, w;
};
struct emu_dim3 {
    unsigned int x = 0, y = 0, z = 0;
};

#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__
#define __launch_bounds__(threads)
#define __shared__ static

inline emu_dim3 threadIdx;
inline emu_dim3 blockIdx;

struct EmuLane {
    ucontext_t start;
    jmp_buf resume;
    bool started = false;
    bool done = false;
    unsigned int generation = 0;  // collectives passed
};

struct EmuWarp {
    EmuLane lanes[32];
    unsigned int current = 0;
    unsigned int warp_base = 0;  // threadIdx.x of lane 0
    // Values and call sites of the last two generations of collectives.
    unsigned int vals[2][32];
    int sites[2][32];
    jmp_buf scheduler;
};
inline EmuWarp *emu_warp_state = nullptr;

[[noreturn]] inline void emu_fail(const char *what) {
    std::fprintf(stderr, "kernel emulator: %s (block %u, thread %u)\n", what, blockIdx.x,
                 threadIdx.x);
    std::abort();
}

// gcc 12 reports a false "may be used uninitialized" inside glibc's _setjmp.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
// Leaves the current lane (its state saved unless it is done) for the next live lane in
// round-robin order, or for the scheduler when every lane is done.
inline void emu_switch() {
    EmuWarp &w = *emu_warp_state;
    EmuLane *me = &w.lanes[w.current];
    if (!me->done && _setjmp(me->resume) != 0) return;  // resumed
    for (unsigned int step = 1; step <= 32; step++) {
        unsigned int next = (w.current + step) % 32u;
        EmuLane &lane = w.lanes[next];
        if (lane.done) continue;
        w.current = next;
        threadIdx.x = w.warp_base + next;
        if (!lane.started) {
            lane.started = true;
            setcontext(&lane.start);
        }
        _longjmp(lane.resume, 1);
    }
    _longjmp(w.scheduler, 1);
}
#pragma GCC diagnostic pop

// Publishes `v` at call site `site`, waits for the other 31 lanes, returns the slot of values.
inline unsigned int *emu_exchange(unsigned int v, int site) {
    EmuWarp &w = *emu_warp_state;
    unsigned int lane = w.current;
    unsigned int g = w.lanes[lane].generation++ & 1u;
    w.vals[g][lane] = v;
    w.sites[g][lane] = site;
    emu_switch();
    for (unsigned int i = 0; i < 32; i++) {
        // A lane that returned from the kernel before reaching this collective.
        if (w.lanes[i].generation < w.lanes[lane].generation)
            emu_fail("a warp collective was not reached by every lane (non-uniform control flow)");
        if (w.sites[g][i] != site) emu_fail("lanes of a warp are at different collectives");
    }
    return w.vals[g];
}

#define __syncwarp(...) ((void)emu_exchange(0u, __LINE__))
#define __ballot_sync(mask, pred) emu_ballot((pred), __LINE__)
#define __shfl_sync(mask, v, src) (emu_exchange((v), __LINE__)[(src) % 32u])
#define __match_any_sync(mask, key) emu_match_any((key), __LINE__)

inline unsigned int emu_ballot(bool pred, int site) {
    unsigned int *vals = emu_exchange(pred ? 1u : 0u, site);
    unsigned int mask = 0;
    for (unsigned int i = 0; i < 32; i++) mask |= vals[i] ? (1u << i) : 0u;
    return mask;
}

inline unsigned int emu_match_any(unsigned int key, int site) {
    unsigned int *vals = emu_exchange(key, site);
    unsigned int mask = 0;
    for (unsigned int i = 0; i < 32; i++) mask |= vals[i] == key ? (1u << i) : 0u;
    return mask;
}

inline int __clz(unsigned int x) { return x == 0 ? 32 : __builtin_clz(x); }
inline int __ffs(unsigned int x) { return __builtin_ffs((int)x); }
inline unsigned int min(unsigned int a, unsigned int b) { return a < b ? a : b; }

// Runs `kernel` (a callable) for every thread of `blocks` blocks of 128 threads: warp by warp,
// each warp's 32 lanes as fibers.
template <typename Kernel>
void emu_launch(unsigned int blocks, Kernel &kernel) {
    static Kernel *current_kernel;
    current_kernel = &kernel;
    constexpr size_t stack_size = 256 * 1024;
    static char stacks[32][stack_size];
    for (unsigned int b = 0; b < blocks; b++) {
        for (unsigned int warp = 0; warp < 4; warp++) {
            EmuWarp w;
            w.warp_base = warp * 32;
            emu_warp_state = &w;
            blockIdx.x = b;
            for (unsigned int i = 0; i < 32; i++) {
                EmuLane &lane = w.lanes[i];
                getcontext(&lane.start);
                lane.start.uc_stack.ss_sp = stacks[i];
                lane.start.uc_stack.ss_size = stack_size;
                lane.start.uc_link = nullptr;
                makecontext(&lane.start, (void (*)()) + [] {
                    (*current_kernel)();
                    emu_warp_state->lanes[emu_warp_state->current].done = true;
                    emu_switch();  // never returns here
                }, 0);
            }
            if (!_setjmp(w.scheduler)) {
                w.current = 0;
                threadIdx.x = w.warp_base;
                w.lanes[0].started = true;
                setcontext(&w.lanes[0].start);
            }
        }
    }
}
