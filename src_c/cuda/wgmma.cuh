// Hopper (sm_90a) warpgroup MMA helpers shared by the kernels that use wgmma:
// the shared-memory descriptor of a 128-byte-swizzled K-major tile, the fence,
// commit and wait around asynchronous wgmmas, and a register pin after a wait.
#pragma once
#include <cstdint>

#include "mma_s8.cuh"

namespace qd {

// Shared-memory matrix descriptor of a K-major tile as TMA writes it with 128-byte
// swizzle: 128-byte rows, atoms of 8 rows (1024 bytes) stacked along M or N.  The
// hardware swizzles on absolute address bits, so moving along K inside the row is
// just a larger start address.
__device__ __forceinline__ uint64_t sw128_desc_at(uint32_t address) {
    return uint64_t((address & 0x3FFFF) >> 4)          // start address, 16-byte units
           | uint64_t(1) << 16                          // leading offset: unused, K fits one row
           | uint64_t(1024 >> 4) << 32                  // stride offset: next 8-row atom
           | uint64_t(1) << 62;                         // 128-byte swizzle
}
__device__ __forceinline__ uint64_t sw128_desc(const void *tile) { return sw128_desc_at(smem_addr(tile)); }

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
// Waits until at most N committed wgmma groups of this warpgroup are in flight.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// wgmma reads its register operands and writes d asynchronously: pin every
// register after the wait so the compiler neither reads d nor reuses an operand's
// registers earlier.
template <int R>
__device__ __forceinline__ void fence_registers(int32_t (&d)[R]) {
#pragma unroll
    for (int i = 0; i < R; ++i) asm volatile("" : "+r"(d[i])::"memory");
}
template <int R>
__device__ __forceinline__ void fence_registers(uint32_t (&d)[R]) {
#pragma unroll
    for (int i = 0; i < R; ++i) asm volatile("" : "+r"(d[i])::"memory");
}
template <int R>
__device__ __forceinline__ void fence_registers(float (&d)[R]) {
#pragma unroll
    for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

}  // namespace qd
