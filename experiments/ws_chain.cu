// Experiment (experiments/ws_chain.py): the batch-1 GEMV chain of many decoder layers as one
// persistent kernel with a warp-specialised weight stream.
//
// Why: a persistent Triton GEMV chain (experiments/persistent_chain.py) kept too few bytes in
// flight per SM and was slower than separate kernels. Here each block (one per SM) has a
// producer warp whose one thread streams the block's share of every weight, projection after
// projection, into a ring of shared-memory slots with bulk async copies (cp.async.bulk +
// mbarrier), never waiting for activations; NUM_CONSUMER_WARPS consumer warps compute the
// dot products and wait at a grid barrier for each projection's input. The producer thus
// keeps streaming the next projection's weights while the consumers wait.
//
// Work split: each block owns a contiguous range of output rows of every projection
// (rows [n*b/P, n*(b+1)/P)), so its weights are one contiguous byte range, balanced to a row.
// A slot holds whole rows (SLOT_BYTES / row bytes of them, at least one); row i of a block's
// range is computed by consumer warp i % NUM_CONSUMER_WARPS. Every consumer warp waits on
// every slot's full barrier in order and arrives on its empty barrier, so no warp runs more
// than one ring round ahead (mbarrier parity waits stay unambiguous).
//
// Only one activation row (batch 1), bf16 weights and activations, float32 accumulation.
// Compile-time constants (NVRTC -D): SLOT_BYTES, NUM_SLOTS, NUM_CONSUMER_WARPS, MAX_K.

struct Step {
    unsigned long long w;    // [n, k] bf16, rows contiguous
    unsigned long long x;    // [k] bf16 (the first row of the input)
    unsigned long long out;  // [n] bf16
    int n;
    int k;                   // a multiple of 8
    int pad0;
    int pad1;
};

__device__ __forceinline__ unsigned smem_u32(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(unsigned long long* bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(smem_u32(bar)), "r"(count)
                 : "memory");
}

__device__ __forceinline__ void mbar_expect_tx(unsigned long long* bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
                 :: "r"(smem_u32(bar)), "r"(bytes) : "memory");
}

__device__ __forceinline__ void mbar_arrive(unsigned long long* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(smem_u32(bar)) : "memory");
}

__device__ __forceinline__ bool mbar_try_wait(unsigned long long* bar, unsigned parity) {
    unsigned done;
    asm volatile("{\n\t.reg .pred p;\n\t"
                 "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
                 "selp.u32 %0, 1, 0, p;\n\t}"
                 : "=r"(done) : "r"(smem_u32(bar)), "r"(parity) : "memory");
    return done != 0;
}

__device__ __forceinline__ void mbar_wait(unsigned long long* bar, unsigned parity) {
    while (!mbar_try_wait(bar, parity)) {
    }
}

__device__ __forceinline__ void bulk_load(void* dst, const void* src, unsigned bytes,
                                          unsigned long long* bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1], %2, [%3];"
                 :: "r"(smem_u32(dst)), "l"(src), "r"(bytes), "r"(smem_u32(bar)) : "memory");
}

__device__ __forceinline__ void grid_arrive(unsigned* counter) {
    asm volatile("red.release.gpu.global.add.u32 [%0], 1;" :: "l"(counter) : "memory");
}

__device__ __forceinline__ unsigned load_acquire(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ uint4 load_l2(const uint4* p) {  // bypass L1: written by other SMs
    uint4 v;
    asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void consumers_sync() {
    asm volatile("bar.sync 1, %0;" :: "r"(NUM_CONSUMER_WARPS * 32) : "memory");
}

__device__ __forceinline__ float dot2(unsigned a, unsigned b) {
    return __uint_as_float(a << 16) * __uint_as_float(b << 16)
         + __uint_as_float(a & 0xffff0000u) * __uint_as_float(b & 0xffff0000u);
}

__device__ __forceinline__ unsigned short to_bf16(float f) {  // round to nearest even
    unsigned u = __float_as_uint(f);
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<unsigned short>(u >> 16);
}

__device__ __forceinline__ void block_rows(const Step& st, int block, int blocks, int& r0,
                                           int& r1, int& per_slot) {
    r0 = static_cast<int>(static_cast<long long>(st.n) * block / blocks);
    r1 = static_cast<int>(static_cast<long long>(st.n) * (block + 1) / blocks);
    per_slot = max(1, SLOT_BYTES / (st.k * 2));
}

extern "C" __global__ void __launch_bounds__((NUM_CONSUMER_WARPS + 1) * 32, 1)
gemv_chain(const Step* __restrict__ steps, int num_steps, unsigned* counter) {
    extern __shared__ __align__(128) unsigned char smem[];
    unsigned char* ring = smem;
    uint4* xs = reinterpret_cast<uint4*>(smem + NUM_SLOTS * SLOT_BYTES);
    unsigned long long* full =
        reinterpret_cast<unsigned long long*>(smem + NUM_SLOTS * SLOT_BYTES + MAX_K * 2);
    unsigned long long* empty = full + NUM_SLOTS;
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int blocks = gridDim.x;
    const int block = blockIdx.x;

    if (threadIdx.x == 0) {
        for (int i = 0; i < NUM_SLOTS; ++i) {
            mbar_init(&full[i], 1);
            mbar_init(&empty[i], NUM_CONSUMER_WARPS);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();

    if (warp == NUM_CONSUMER_WARPS) {  // the producer
        if (lane != 0) {
            return;
        }
        unsigned chunk = 0;
        for (int s = 0; s < num_steps; ++s) {
            const Step st = steps[s];
            int r0, r1, per_slot;
            block_rows(st, block, blocks, r0, r1, per_slot);
            const unsigned char* w = reinterpret_cast<const unsigned char*>(st.w);
            for (int r = r0; r < r1; r += per_slot, ++chunk) {
                const unsigned slot = chunk % NUM_SLOTS;
                const unsigned round = chunk / NUM_SLOTS;
                if (round > 0) {
                    mbar_wait(&empty[slot], (round - 1) & 1u);
                }
                const unsigned bytes = static_cast<unsigned>(min(per_slot, r1 - r)) * st.k * 2;
                mbar_expect_tx(&full[slot], bytes);
                bulk_load(ring + slot * SLOT_BYTES, w + static_cast<size_t>(r) * st.k * 2, bytes,
                          &full[slot]);
            }
        }
        return;
    }

    unsigned chunk = 0;
    for (int s = 0; s < num_steps; ++s) {
        const Step st = steps[s];
        int r0, r1, per_slot;
        block_rows(st, block, blocks, r0, r1, per_slot);
        if (s > 0) {  // grid barrier: every block finished projection s - 1
            if (threadIdx.x == 0) {
                const unsigned target = static_cast<unsigned>(s) * blocks;
                while (load_acquire(counter) < target) {
                }
            }
            consumers_sync();
        }
        const int vecs = st.k / 8;  // 16-byte vectors a row
        const uint4* xg = reinterpret_cast<const uint4*>(st.x);
        for (int i = threadIdx.x; i < vecs; i += NUM_CONSUMER_WARPS * 32) {
            xs[i] = load_l2(xg + i);
        }
        consumers_sync();
        unsigned short* out = reinterpret_cast<unsigned short*>(st.out);
        for (int r = r0; r < r1; r += per_slot, ++chunk) {
            const unsigned slot = chunk % NUM_SLOTS;
            mbar_wait(&full[slot], (chunk / NUM_SLOTS) & 1u);
            const int rows = min(per_slot, r1 - r);
            for (int j = 0; j < rows; ++j) {
                if ((r - r0 + j) % NUM_CONSUMER_WARPS != warp) {
                    continue;
                }
                const uint4* wr = reinterpret_cast<const uint4*>(
                    ring + slot * SLOT_BYTES + static_cast<size_t>(j) * st.k * 2);
                float acc = 0.0f;
                for (int v = lane; v < vecs; v += 32) {
                    const uint4 a = wr[v];
                    const uint4 b = xs[v];
                    acc += dot2(a.x, b.x) + dot2(a.y, b.y) + dot2(a.z, b.z) + dot2(a.w, b.w);
                }
                for (int o = 16; o > 0; o >>= 1) {
                    acc += __shfl_xor_sync(0xffffffffu, acc, o);
                }
                if (lane == 0) {
                    out[r + j] = to_bf16(acc);
                }
            }
            __syncwarp();
            if (lane == 0) {
                mbar_arrive(&empty[slot]);
            }
        }
        consumers_sync();  // this block's outputs of projection s are written
        if (threadIdx.x == 0) {
            __threadfence();
            grid_arrive(counter);
        }
    }
}
