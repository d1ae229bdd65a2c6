// wrk fixed kernels: the device operators that are not generated per expression.
//
// Compiled once per worker with NVRTC (see kernels/compile.rs). The hash functions at the top are
// plain C++ as well: the tests compile that section with the host compiler and check it against
// the CPU backend's partition hash (cpu/keys.rs), the contract every backend must honour.
//
// Conventions: `n` is a row count (long long); validity is one byte per row, and a null validity
// pointer means every row is valid; row indices are unsigned int, WRK_NONE marks "no row" (the
// unmatched side of a left join), which gathers as null.

typedef unsigned long long wrk_u64;
typedef long long wrk_i64;
typedef unsigned int wrk_u32;
typedef unsigned char wrk_u8;

#if defined(__CUDACC__) || defined(__CUDACC_RTC__) || defined(WRK_CUDA_EMULATOR)
#define WRK_HD __device__ __forceinline__
WRK_HD wrk_u64 wrk_double_bits(double v) { return (wrk_u64)__double_as_longlong(v); }
#else
#include <cstring>
#define WRK_HD inline
inline wrk_u64 wrk_double_bits(double v) {
    wrk_u64 bits;
    std::memcpy(&bits, &v, 8);
    return bits;
}
#endif

// ---------------------------------------------------------------------------------------------
// The partition hash contract (cpu/keys.rs `partition_hashes`).
// ---------------------------------------------------------------------------------------------

#define WRK_NULL_HASH 0x9e3779b97f4a7c15ULL
#define WRK_MIX_M1 0xff51afd7ed558ccdULL
#define WRK_MIX_M2 0xc4ceb9fe1a85ec53ULL

// MurmurHash3's 64-bit finaliser.
WRK_HD wrk_u64 wrk_mix(wrk_u64 h) {
    h ^= h >> 33;
    h *= WRK_MIX_M1;
    h ^= h >> 33;
    h *= WRK_MIX_M2;
    return h ^ (h >> 33);
}

WRK_HD wrk_u64 wrk_rotl(wrk_u64 x, int r) { return (x << r) | (x >> (64 - r)); }

// Several keys combine left to right: h = mix(rotl(h, 5) ^ key_hash), from h = 0.
WRK_HD wrk_u64 wrk_combine(wrk_u64 h, wrk_u64 key_hash) { return wrk_mix(wrk_rotl(h, 5) ^ key_hash); }

// Floats hash their f64 bits, -0.0 as 0.0 and every NaN as Rust's f64::NAN.
WRK_HD wrk_u64 wrk_float_bits(double v) {
    if (v == 0.0) return 0ULL;
    if (v != v) return 0x7ff8000000000000ULL;
    return wrk_double_bits(v);
}

#define WRK_XXH_P1 11400714785074694791ULL
#define WRK_XXH_P2 14029467366897019727ULL
#define WRK_XXH_P3 1609587929392839161ULL
#define WRK_XXH_P4 9650029242287828579ULL
#define WRK_XXH_P5 2870177450012600261ULL

WRK_HD wrk_u64 wrk_read64(const wrk_u8* p) {
    wrk_u64 v = 0;
    for (int b = 7; b >= 0; b--) v = (v << 8) | p[b];
    return v;
}

WRK_HD wrk_u64 wrk_read32(const wrk_u8* p) {
    return (wrk_u64)p[0] | ((wrk_u64)p[1] << 8) | ((wrk_u64)p[2] << 16) | ((wrk_u64)p[3] << 24);
}

WRK_HD wrk_u64 wrk_xxh_round(wrk_u64 acc, wrk_u64 input) {
    acc += input * WRK_XXH_P2;
    acc = wrk_rotl(acc, 31);
    return acc * WRK_XXH_P1;
}

WRK_HD wrk_u64 wrk_xxh_merge(wrk_u64 acc, wrk_u64 v) {
    acc ^= wrk_xxh_round(0, v);
    return acc * WRK_XXH_P1 + WRK_XXH_P4;
}

// XXH64 with seed 0, as twox_hash::XxHash64::oneshot(0, bytes).
WRK_HD wrk_u64 wrk_xxh64(const wrk_u8* p, wrk_u64 len) {
    const wrk_u8* end = p + len;
    wrk_u64 h;
    if (len >= 32) {
        wrk_u64 v1 = WRK_XXH_P1 + WRK_XXH_P2, v2 = WRK_XXH_P2, v3 = 0, v4 = 0ULL - WRK_XXH_P1;
        while (p + 32 <= end) {
            v1 = wrk_xxh_round(v1, wrk_read64(p));
            v2 = wrk_xxh_round(v2, wrk_read64(p + 8));
            v3 = wrk_xxh_round(v3, wrk_read64(p + 16));
            v4 = wrk_xxh_round(v4, wrk_read64(p + 24));
            p += 32;
        }
        h = wrk_rotl(v1, 1) + wrk_rotl(v2, 7) + wrk_rotl(v3, 12) + wrk_rotl(v4, 18);
        h = wrk_xxh_merge(h, v1);
        h = wrk_xxh_merge(h, v2);
        h = wrk_xxh_merge(h, v3);
        h = wrk_xxh_merge(h, v4);
    } else {
        h = WRK_XXH_P5;
    }
    h += len;
    while (p + 8 <= end) {
        h ^= wrk_xxh_round(0, wrk_read64(p));
        h = wrk_rotl(h, 27) * WRK_XXH_P1 + WRK_XXH_P4;
        p += 8;
    }
    if (p + 4 <= end) {
        h ^= wrk_read32(p) * WRK_XXH_P1;
        h = wrk_rotl(h, 23) * WRK_XXH_P2 + WRK_XXH_P3;
        p += 4;
    }
    while (p < end) {
        h ^= (*p) * WRK_XXH_P5;
        h = wrk_rotl(h, 11) * WRK_XXH_P1;
        p++;
    }
    h ^= h >> 33;
    h *= WRK_XXH_P2;
    h ^= h >> 29;
    h *= WRK_XXH_P3;
    return h ^ (h >> 32);
}

// The key hash of one value of each kind (before combining).
WRK_HD wrk_u64 wrk_hash_signed(wrk_i64 v) { return wrk_mix((wrk_u64)v); }
WRK_HD wrk_u64 wrk_hash_unsigned(wrk_u64 v) { return wrk_mix(v); }
WRK_HD wrk_u64 wrk_hash_float(double v) { return wrk_mix(wrk_float_bits(v)); }
WRK_HD wrk_u64 wrk_hash_bytes(const wrk_u8* p, wrk_u64 len) { return wrk_mix(wrk_xxh64(p, len)); }

#if defined(__CUDACC__) || defined(__CUDACC_RTC__) || defined(WRK_CUDA_EMULATOR)

#define WRK_NONE 0xffffffffu
#define WRK_ROWS(i, n) \
    for (wrk_i64 i = blockIdx.x * (wrk_i64)blockDim.x + threadIdx.x; i < (n); i += (wrk_i64)blockDim.x * gridDim.x)
#define WRK_VALID(valid, i) ((valid) == 0 || (valid)[i] != 0)

// Accumulating rows into few groups (a group-by's aggregates, a hash-partition's counts): every
// row adding into one of a few global accumulators serialises the whole GPU on their atomics
// (one address, or a few in one cache line of one L2 slice). With at most WRK_SHARED_GROUPS
// groups, each warp of a block adds into its own copy of the accumulators in shared memory, and
// the block adds its copies into the global ones once at the end; the host launches such
// kernels over fewer blocks (exec::accumulate_config), so there are few of those adds. More
// groups spread the atomics over many addresses: rows add into the global accumulators.
//
// WRK_ACCUMULATE(ACC, acc, groups, identity, KEEP, GROUP, VALUE, ADD, COMBINE): for each row
// i (grid-stride) where KEEP(i), ADD(&acc[GROUP(i)], VALUE(i)), ADD being an atomic and
// COMBINE(a, b) the same operation on two values, with `identity` its neutral value.
#define WRK_SHARED_GROUPS 256
#define WRK_SHARED_WARPS 8
#define WRK_ACCUMULATE(ACC, acc, groups, identity, KEEP, GROUP, VALUE, ADD, COMBINE)                      \
    __shared__ ACC wrk_shared[WRK_SHARED_WARPS * WRK_SHARED_GROUPS];                                     \
    if ((groups) <= WRK_SHARED_GROUPS && blockDim.x <= 32 * WRK_SHARED_WARPS) {                          \
        const int wrk_warps = (blockDim.x + 31) >> 5;                                                     \
        for (int s = threadIdx.x; s < wrk_warps * (int)(groups); s += blockDim.x) wrk_shared[s] = (identity); \
        __syncthreads();                                                                                  \
        ACC* wrk_mine = wrk_shared + (threadIdx.x >> 5) * (int)(groups);                                  \
        WRK_ROWS(i, n) {                                                                                  \
            if (KEEP(i)) ADD(&wrk_mine[GROUP(i)], VALUE(i));                                              \
        }                                                                                                 \
        __syncthreads();                                                                                  \
        for (int g = threadIdx.x; g < (int)(groups); g += blockDim.x) {                                   \
            ACC total = wrk_shared[g];                                                                    \
            for (int w = 1; w < wrk_warps; w++) total = COMBINE(total, wrk_shared[w * (int)(groups) + g]); \
            ADD(&(acc)[g], total);                                                                        \
        }                                                                                                 \
    } else {                                                                                              \
        WRK_ROWS(i, n) {                                                                                  \
            if (KEEP(i)) ADD(&(acc)[GROUP(i)], VALUE(i));                                                 \
        }                                                                                                 \
    }
#define WRK_PLUS(a, b) ((a) + (b))
#define WRK_LESSER(a, b) ((b) < (a) ? (b) : (a))
#define WRK_GREATER(a, b) ((b) > (a) ? (b) : (a))

// ---------------------------------------------------------------------------------------------
// Hash-partition: combine one key column into the row hashes, then pick partition rows.
// ---------------------------------------------------------------------------------------------

#define WRK_HASH_KERNEL(name, T, EXPR)                                                          \
    extern "C" __global__ void name(const T* values, const wrk_u8* valid, wrk_u64* hashes, wrk_i64 n) { \
        WRK_ROWS(i, n) {                                                                        \
            wrk_u64 k = WRK_VALID(valid, i) ? EXPR : WRK_NULL_HASH;                             \
            hashes[i] = wrk_combine(hashes[i], k);                                              \
        }                                                                                       \
    }
WRK_HASH_KERNEL(wrk_hash_i8, signed char, wrk_hash_signed((wrk_i64)values[i]))
WRK_HASH_KERNEL(wrk_hash_i16, short, wrk_hash_signed((wrk_i64)values[i]))
WRK_HASH_KERNEL(wrk_hash_i32, int, wrk_hash_signed((wrk_i64)values[i]))
WRK_HASH_KERNEL(wrk_hash_i64, long long, wrk_hash_signed((wrk_i64)values[i]))
WRK_HASH_KERNEL(wrk_hash_u8, unsigned char, wrk_hash_unsigned((wrk_u64)values[i]))
WRK_HASH_KERNEL(wrk_hash_u16, unsigned short, wrk_hash_unsigned((wrk_u64)values[i]))
WRK_HASH_KERNEL(wrk_hash_u32, unsigned int, wrk_hash_unsigned((wrk_u64)values[i]))
WRK_HASH_KERNEL(wrk_hash_u64, unsigned long long, wrk_hash_unsigned(values[i]))
WRK_HASH_KERNEL(wrk_hash_f32, float, wrk_hash_float((double)values[i]))
WRK_HASH_KERNEL(wrk_hash_f64, double, wrk_hash_float(values[i]))

// Strings: `offsets` (n + 1 int32) into `bytes`.
extern "C" __global__ void wrk_hash_str(const int* offsets, const wrk_u8* bytes, const wrk_u8* valid,
                                        wrk_u64* hashes, wrk_i64 n) {
    WRK_ROWS(i, n) {
        wrk_u64 k = WRK_VALID(valid, i)
                        ? wrk_hash_bytes(bytes + offsets[i], (wrk_u64)(offsets[i + 1] - offsets[i]))
                        : WRK_NULL_HASH;
        hashes[i] = wrk_combine(hashes[i], k);
    }
}

// Row i's partition of `parts` (as a word to sort by), counted in `counts`.
extern "C" __global__ void wrk_partition_of(const wrk_u64* hashes, wrk_u64 parts, wrk_u64* words,
                                            wrk_u32* counts, wrk_i64 n) {
#define WRK_PART_KEEP(i) (words[i] = hashes[i] % parts, true)
#define WRK_PART_GROUP(i) words[i]
#define WRK_ONE(i) 1u
    WRK_ACCUMULATE(wrk_u32, counts, parts, 0u, WRK_PART_KEEP, WRK_PART_GROUP, WRK_ONE, atomicAdd, WRK_PLUS)
#undef WRK_PART_KEEP
#undef WRK_PART_GROUP
#undef WRK_ONE
}

// ---------------------------------------------------------------------------------------------
// Stream compaction: exclusive prefix sums of 0/1 flags, then the selected row indices.
// ---------------------------------------------------------------------------------------------

// Exclusive scan of each block of blockDim.x (a multiple of 32, at most 1024) values; the block's
// total goes to block_sums. Launched with exactly ceil(n / blockDim.x) blocks.
extern "C" __global__ void wrk_scan_blocks(const wrk_u32* in, wrk_u32* out, wrk_u32* block_sums, wrk_i64 n) {
    __shared__ wrk_u32 warp_sums[32];
    wrk_i64 i = blockIdx.x * (wrk_i64)blockDim.x + threadIdx.x;
    wrk_u32 v = i < n ? in[i] : 0u;
    unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    wrk_u32 x = v;
    for (int o = 1; o < 32; o <<= 1) {
        wrk_u32 y = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= (unsigned)o) x += y;
    }
    if (lane == 31u) warp_sums[warp] = x;
    __syncthreads();
    if (warp == 0) {
        wrk_u32 s = lane < (blockDim.x >> 5) ? warp_sums[lane] : 0u;
        for (int o = 1; o < 32; o <<= 1) {
            wrk_u32 y = __shfl_up_sync(0xffffffffu, s, o);
            if (lane >= (unsigned)o) s += y;
        }
        warp_sums[lane] = s;
    }
    __syncthreads();
    wrk_u32 before = warp > 0 ? warp_sums[warp - 1] : 0u;
    if (i < n) out[i] = before + x - v;
    if (threadIdx.x == blockDim.x - 1) block_sums[blockIdx.x] = before + x;
}

// Adds each block's offset (the exclusive scan of the block sums) to its values.
extern "C" __global__ void wrk_scan_add(wrk_u32* out, const wrk_u32* block_offsets, wrk_i64 n) {
    wrk_i64 i = blockIdx.x * (wrk_i64)blockDim.x + threadIdx.x;
    if (i < n) out[i] += block_offsets[blockIdx.x];
}

// 1 where a boolean predicate is true and valid (a null predicate drops the row, as in Arrow).
extern "C" __global__ void wrk_mask_flags(const wrk_u8* mask, const wrk_u8* valid, wrk_u32* flags, wrk_i64 n) {
    WRK_ROWS(i, n) { flags[i] = (mask[i] != 0 && WRK_VALID(valid, i)) ? 1u : 0u; }
}

// 1 where a row is valid.
extern "C" __global__ void wrk_valid_flags(const wrk_u8* valid, wrk_u32* flags, wrk_i64 n) {
    WRK_ROWS(i, n) { flags[i] = WRK_VALID(valid, i) ? 1u : 0u; }
}

// The selected rows in order: indices[positions[i]] = i where flags[i].
extern "C" __global__ void wrk_selected_rows(const wrk_u32* flags, const wrk_u32* positions, wrk_u32* indices,
                                             wrk_i64 n) {
    WRK_ROWS(i, n) {
        if (flags[i]) indices[positions[i]] = (wrk_u32)i;
    }
}

// ---------------------------------------------------------------------------------------------
// Gathers (take): dst[j] = src[indices[j]]; WRK_NONE gathers a zero value and a null.
// ---------------------------------------------------------------------------------------------

#define WRK_GATHER_KERNEL(name, T)                                                                 \
    extern "C" __global__ void name(const T* src, const wrk_u32* indices, T* dst, wrk_i64 m) {      \
        WRK_ROWS(j, m) {                                                                           \
            wrk_u32 r = indices[j];                                                                \
            dst[j] = r == WRK_NONE ? (T)0 : src[r];                                                \
        }                                                                                          \
    }
WRK_GATHER_KERNEL(wrk_gather_1, unsigned char)
WRK_GATHER_KERNEL(wrk_gather_2, unsigned short)
WRK_GATHER_KERNEL(wrk_gather_4, unsigned int)
WRK_GATHER_KERNEL(wrk_gather_8, unsigned long long)

extern "C" __global__ void wrk_gather_valid(const wrk_u8* valid, const wrk_u32* indices, wrk_u8* dst, wrk_i64 m) {
    WRK_ROWS(j, m) {
        wrk_u32 r = indices[j];
        dst[j] = (r != WRK_NONE && WRK_VALID(valid, r)) ? 1 : 0;
    }
}

// Strings, in two steps: the lengths of the gathered rows (scanned into offsets by the host),
// then the bytes.
extern "C" __global__ void wrk_gather_str_lengths(const int* offsets, const wrk_u32* indices, wrk_u32* lengths,
                                                  wrk_i64 m) {
    WRK_ROWS(j, m) {
        wrk_u32 r = indices[j];
        lengths[j] = r == WRK_NONE ? 0u : (wrk_u32)(offsets[r + 1] - offsets[r]);
    }
}

extern "C" __global__ void wrk_gather_str_bytes(const int* offsets, const wrk_u8* bytes, const wrk_u32* indices,
                                                const wrk_u32* dst_offsets, wrk_u8* dst, wrk_i64 m) {
    WRK_ROWS(j, m) {
        wrk_u32 r = indices[j];
        if (r == WRK_NONE) continue;
        const wrk_u8* from = bytes + offsets[r];
        wrk_u8* to = dst + dst_offsets[j];
        int len = offsets[r + 1] - offsets[r];
        for (int b = 0; b < len; b++) to[b] = from[b];
    }
}

// u32 offsets (from a scan) to Arrow's int32 offsets, the last one being `total`.
extern "C" __global__ void wrk_offsets_to_i32(const wrk_u32* positions, wrk_u32 total, int* offsets, wrk_i64 m) {
    WRK_ROWS(j, m + 1) { offsets[j] = (int)(j < m ? positions[j] : total); }
}

// n copies of a `len`-byte string: offsets (n + 1 of them, the kernel launched over n + 1 rows)
// and bytes.
extern "C" __global__ void wrk_repeat_str(const wrk_u8* text, int len, int* offsets, wrk_u8* bytes, wrk_i64 n) {
    WRK_ROWS(i, n + 1) {
        offsets[i] = (int)(i * len);
        if (i < n)
            for (int b = 0; b < len; b++) bytes[i * len + b] = text[b];
    }
}

// Concat: dst[i] = src[i] + delta (string offsets of a table appended after others).
extern "C" __global__ void wrk_offsets_shift(const int* src, int delta, int* dst, wrk_i64 count) {
    WRK_ROWS(i, count) { dst[i] = src[i] + delta; }
}

// Fills.
extern "C" __global__ void wrk_fill_u32(wrk_u32* dst, wrk_u32 value, wrk_i64 n) {
    WRK_ROWS(i, n) { dst[i] = value; }
}
extern "C" __global__ void wrk_fill_u8(wrk_u8* dst, wrk_u8 value, wrk_i64 n) {
    WRK_ROWS(i, n) { dst[i] = value; }
}
extern "C" __global__ void wrk_iota_u32(wrk_u32* dst, wrk_u32 start, wrk_i64 n) {
    WRK_ROWS(i, n) { dst[i] = start + (wrk_u32)i; }
}

// ---------------------------------------------------------------------------------------------
// Key words: a 64-bit word per row that is equal exactly when the keys are (group-by, join), or
// ordered as the keys are (sort).
// ---------------------------------------------------------------------------------------------

// Equality words: integers widened (signed sign-extended), floats by their f64 bits (as Arrow's
// row format compares them: -0.0 and 0.0 differ, as do NaN payloads).
#define WRK_EQ_WORD_KERNEL(name, T, EXPR)                                                     \
    extern "C" __global__ void name(const T* values, wrk_u64* words, wrk_i64 n) {             \
        WRK_ROWS(i, n) { words[i] = EXPR; }                                                   \
    }
WRK_EQ_WORD_KERNEL(wrk_eq_word_i8, signed char, (wrk_u64)(wrk_i64)values[i])
WRK_EQ_WORD_KERNEL(wrk_eq_word_i16, short, (wrk_u64)(wrk_i64)values[i])
WRK_EQ_WORD_KERNEL(wrk_eq_word_i32, int, (wrk_u64)(wrk_i64)values[i])
WRK_EQ_WORD_KERNEL(wrk_eq_word_i64, long long, (wrk_u64)values[i])
WRK_EQ_WORD_KERNEL(wrk_eq_word_u8, unsigned char, (wrk_u64)values[i])
WRK_EQ_WORD_KERNEL(wrk_eq_word_u16, unsigned short, (wrk_u64)values[i])
WRK_EQ_WORD_KERNEL(wrk_eq_word_u32, unsigned int, (wrk_u64)values[i])
WRK_EQ_WORD_KERNEL(wrk_eq_word_u64, unsigned long long, values[i])
WRK_EQ_WORD_KERNEL(wrk_eq_word_f32, float, wrk_double_bits((double)values[i]))
WRK_EQ_WORD_KERNEL(wrk_eq_word_f64, double, wrk_double_bits(values[i]))

// String keys have no exact 64-bit word: their equality word is the XXH64 of their bytes, and
// the operators check that rows with equal words hold equal strings (the kernels below), so a
// hash collision never merges two keys (group-by and the join build refuse, the probe drops
// the false match).
WRK_HD int wrk_str_equal(const int* a_offsets, const wrk_u8* a_bytes, wrk_u32 a, const int* b_offsets,
                         const wrk_u8* b_bytes, wrk_u32 b) {
    int len = a_offsets[a + 1] - a_offsets[a];
    if (len != b_offsets[b + 1] - b_offsets[b]) return 0;
    const wrk_u8* p = a_bytes + a_offsets[a];
    const wrk_u8* q = b_bytes + b_offsets[b];
    for (int i = 0; i < len; i++)
        if (p[i] != q[i]) return 0;
    return 1;
}

extern "C" __global__ void wrk_eq_word_str(const int* offsets, const wrk_u8* bytes, wrk_u64* words, wrk_i64 n) {
    WRK_ROWS(i, n) { words[i] = wrk_xxh64(bytes + offsets[i], (wrk_u64)(offsets[i + 1] - offsets[i])); }
}

// Counts the valid rows whose string differs from their group's first row's.
extern "C" __global__ void wrk_str_group_check(const int* offsets, const wrk_u8* bytes, const wrk_u8* valid,
                                               const wrk_u32* row_group, const wrk_u32* group_first_row,
                                               wrk_u32* mismatches, wrk_i64 n) {
    WRK_ROWS(i, n) {
        if (WRK_VALID(valid, i) &&
            !wrk_str_equal(offsets, bytes, (wrk_u32)i, offsets, bytes, group_first_row[row_group[i]]))
            atomicAdd(mismatches, 1u);
    }
}

// Counts the build rows (sorted by word: `order` into `words`, `rows` the table rows in that
// order) whose word equals their predecessor's but whose string does not.
extern "C" __global__ void wrk_str_run_check(const int* offsets, const wrk_u8* bytes, const wrk_u64* words,
                                             const wrk_u32* order, const wrk_u32* rows, wrk_u32* mismatches,
                                             wrk_i64 n) {
    WRK_ROWS(i, n) {
        if (i > 0 && words[order[i]] == words[order[i - 1]] &&
            !wrk_str_equal(offsets, bytes, rows[i], offsets, bytes, rows[i - 1]))
            atomicAdd(mismatches, 1u);
    }
}

// Drops a probe row's match when its string differs from the matched run's (whose strings are
// all equal, so it has no match at all).
extern "C" __global__ void wrk_str_probe_check(const int* probe_offsets, const wrk_u8* probe_bytes,
                                               const int* build_offsets, const wrk_u8* build_bytes,
                                               const wrk_u32* build_order, const wrk_u32* match_start,
                                               wrk_u32* match_count, wrk_i64 n) {
    WRK_ROWS(i, n) {
        if (match_count[i] > 0 && !wrk_str_equal(probe_offsets, probe_bytes, (wrk_u32)i, build_offsets,
                                                 build_bytes, build_order[match_start[i]]))
            match_count[i] = 0;
    }
}

// The longest of the strings at `rows` (atomicMax into `longest`, which starts at 0).
extern "C" __global__ void wrk_str_longest(const int* offsets, const wrk_u32* rows, wrk_u32* longest, wrk_i64 m) {
    WRK_ROWS(j, m) {
        wrk_u32 r = rows[j];
        atomicMax(longest, (wrk_u32)(offsets[r + 1] - offsets[r]));
    }
}

// Order words of strings, compared as byte strings (Rust's `str` order): the strings at `rows`
// read as big-endian words of 8 bytes, zero-padded; bytes [8 * chunk, 8 * chunk + 8) here. With
// their lengths last (`chunk` < 0), an LSD sort by length, then chunks from the last to the
// first, orders them; descending inverts every word.
extern "C" __global__ void wrk_str_order_word(const int* offsets, const wrk_u8* bytes, const wrk_u32* rows,
                                              int chunk, int descending, wrk_u64* words, wrk_i64 m) {
    WRK_ROWS(j, m) {
        wrk_u32 r = rows[j];
        int start = offsets[r], len = offsets[r + 1] - start;
        wrk_u64 w = 0;
        if (chunk < 0) {
            w = (wrk_u64)len;
        } else {
            for (int b = 0; b < 8; b++) {
                int at = chunk * 8 + b;
                w = (w << 8) | (at < len ? (wrk_u64)bytes[start + at] : 0ULL);
            }
        }
        words[j] = descending ? ~w : w;
    }
}

// rank[order[j]] = j: the place of each group in sorted order.
extern "C" __global__ void wrk_ranks(const wrk_u32* order, wrk_u32* rank, wrk_i64 m) {
    WRK_ROWS(j, m) { rank[order[j]] = (wrk_u32)j; }
}

// Each row's word: its group's rank.
extern "C" __global__ void wrk_rank_words(const wrk_u32* row_group, const wrk_u32* rank, wrk_u64* words, wrk_i64 n) {
    WRK_ROWS(i, n) { words[i] = (wrk_u64)rank[row_group[i]]; }
}

// Order words: unsigned order of the word is the key order (signed: sign bit flipped; floats:
// IEEE total order, as f64::total_cmp); descending inverts the word; a null row's word is 0 (its
// place is decided by a separate null pass, so nulls keep their relative order).
WRK_HD wrk_u64 wrk_order_signed(wrk_i64 v) { return (wrk_u64)v ^ 0x8000000000000000ULL; }
WRK_HD wrk_u64 wrk_order_float(double v) {
    wrk_i64 x = (wrk_i64)wrk_double_bits(v);
    x ^= (wrk_i64)(((wrk_u64)(x >> 63)) >> 1);
    return (wrk_u64)x ^ 0x8000000000000000ULL;
}
#define WRK_ORDER_WORD_KERNEL(name, T, EXPR)                                                          \
    extern "C" __global__ void name(const T* values, const wrk_u8* valid, int descending, wrk_u64* words, \
                                    wrk_i64 n) {                                                      \
        WRK_ROWS(i, n) {                                                                              \
            wrk_u64 w = EXPR;                                                                         \
            words[i] = WRK_VALID(valid, i) ? (descending ? ~w : w) : 0ULL;                            \
        }                                                                                             \
    }
WRK_ORDER_WORD_KERNEL(wrk_order_word_i8, signed char, wrk_order_signed((wrk_i64)values[i]))
WRK_ORDER_WORD_KERNEL(wrk_order_word_i16, short, wrk_order_signed((wrk_i64)values[i]))
WRK_ORDER_WORD_KERNEL(wrk_order_word_i32, int, wrk_order_signed((wrk_i64)values[i]))
WRK_ORDER_WORD_KERNEL(wrk_order_word_i64, long long, wrk_order_signed(values[i]))
WRK_ORDER_WORD_KERNEL(wrk_order_word_u8, unsigned char, (wrk_u64)values[i])
WRK_ORDER_WORD_KERNEL(wrk_order_word_u16, unsigned short, (wrk_u64)values[i])
WRK_ORDER_WORD_KERNEL(wrk_order_word_u32, unsigned int, (wrk_u64)values[i])
WRK_ORDER_WORD_KERNEL(wrk_order_word_u64, unsigned long long, values[i])
WRK_ORDER_WORD_KERNEL(wrk_order_word_f32, float, wrk_order_float((double)values[i]))
WRK_ORDER_WORD_KERNEL(wrk_order_word_f64, double, wrk_order_float(values[i]))

// The null pass of a sort key: bit 0 orders nulls first or last.
extern "C" __global__ void wrk_null_word(const wrk_u8* valid, int nulls_first, wrk_u64* words, wrk_i64 n) {
    WRK_ROWS(i, n) {
        int is_null = !WRK_VALID(valid, i);
        words[i] = (wrk_u64)(nulls_first ? !is_null : is_null);
    }
}

// ---------------------------------------------------------------------------------------------
// Radix sort (LSD, one bit per pass, stable): each pass partitions the permutation by one bit of
// the words it points at, zeros first, with a prefix sum of the zero flags.
// ---------------------------------------------------------------------------------------------

// The OR and AND of all words: only bits that differ between rows need a pass.
// or_and[0] |= every word, or_and[1] &= every word. Each block reduces its threads' words
// (warps by shuffles, then the warps) and adds them with one atomic each: one atomic per thread
// on these two words serialised the GPU (29 ms for 20 M words on an H200). The host launches it
// over few blocks (exec::accumulate_config).
extern "C" __global__ void wrk_bits_in_use(const wrk_u64* words, wrk_u64* or_and, wrk_i64 n) {
    __shared__ wrk_u64 warp_any[32], warp_all[32];
    wrk_u64 any = 0ULL, all = ~0ULL;
    WRK_ROWS(i, n) {
        any |= words[i];
        all &= words[i];
    }
    for (int o = 16; o > 0; o >>= 1) {
        any |= __shfl_down_sync(0xffffffffu, any, o);
        all &= __shfl_down_sync(0xffffffffu, all, o);
    }
    const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    if (lane == 0u) {
        warp_any[warp] = any;
        warp_all[warp] = all;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (unsigned w = 1; w < (blockDim.x + 31u) >> 5; w++) {
            any |= warp_any[w];
            all &= warp_all[w];
        }
        atomicOr(&or_and[0], any);
        atomicAnd(&or_and[1], all);
    }
}

// Radix sort (LSD, stable) by 4-bit digits of (key, row) pairs, which move together so that each
// pass reads its keys in order. A block takes a tile of WRK_RADIX_TILE keys and each of its
// WRK_RADIX_THREADS threads a run of WRK_RADIX_ITEMS consecutive ones, so the keys of one digit
// keep the input's order within the tile (threads in order, each its run in order). A thread
// counts its run's digits in one word, 4 bits per digit (a run has fewer than 16 keys).
#define WRK_RADIX_DIGITS 16
#define WRK_RADIX_ITEMS 8
#define WRK_RADIX_THREADS 256
#define WRK_RADIX_TILE (WRK_RADIX_THREADS * WRK_RADIX_ITEMS)
#define WRK_RADIX_SEGMENT 16
#define WRK_RADIX_DIGIT(key, shift) ((unsigned)(((key) >> (shift)) & 15ULL))

// The counts of this thread's run: WRK_RADIX_DIGITS fields of 4 bits.
#define WRK_RADIX_RUN_COUNTS(packed, keys, shift, n)                                               \
    wrk_u64 packed = 0ULL;                                                                         \
    const wrk_i64 wrk_run = (wrk_i64)blockIdx.x * WRK_RADIX_TILE + (wrk_i64)threadIdx.x * WRK_RADIX_ITEMS; \
    for (int j = 0; j < WRK_RADIX_ITEMS; j++) {                                                    \
        if (wrk_run + j < (n)) packed += 1ULL << (4 * WRK_RADIX_DIGIT((keys)[wrk_run + j], shift)); \
    }

// prefix[d][t]: the keys of digit d in the runs of threads before t; total[d]: in the tile. Each
// thread (d, s) = (t % 16, t / 16) scans row d's segment s of 16 threads, then adds the
// segments before it. Rows are padded by one word so the 16 rows fall in different banks.
#define WRK_RADIX_BLOCK_PREFIX(packed, prefix, total)                                              \
    __shared__ wrk_u32 prefix[WRK_RADIX_DIGITS][WRK_RADIX_THREADS + 1];                            \
    __shared__ wrk_u32 wrk_segments[WRK_RADIX_DIGITS][WRK_RADIX_THREADS / WRK_RADIX_SEGMENT];      \
    __shared__ wrk_u32 total[WRK_RADIX_DIGITS];                                                    \
    for (int d = 0; d < WRK_RADIX_DIGITS; d++) prefix[d][threadIdx.x] = (wrk_u32)((packed >> (4 * d)) & 15ULL); \
    __syncthreads();                                                                               \
    {                                                                                              \
        const int d = threadIdx.x % WRK_RADIX_DIGITS, s = threadIdx.x / WRK_RADIX_DIGITS;         \
        wrk_u32 run = 0;                                                                           \
        for (int k = 0; k < WRK_RADIX_SEGMENT; k++) {                                              \
            wrk_u32 v = prefix[d][s * WRK_RADIX_SEGMENT + k];                                      \
            prefix[d][s * WRK_RADIX_SEGMENT + k] = run;                                            \
            run += v;                                                                              \
        }                                                                                          \
        wrk_segments[d][s] = run;                                                                  \
        __syncthreads();                                                                           \
        wrk_u32 before = 0;                                                                        \
        for (int k = 0; k < s; k++) before += wrk_segments[d][k];                                  \
        for (int k = 0; k < WRK_RADIX_SEGMENT; k++) prefix[d][s * WRK_RADIX_SEGMENT + k] += before; \
        if (s == WRK_RADIX_THREADS / WRK_RADIX_SEGMENT - 1) total[d] = before + run;               \
    }                                                                                              \
    __syncthreads();

// counts[d * tiles + b]: the keys of tile b whose digit at `shift` is d (launched with
// WRK_RADIX_THREADS threads per block, one block per tile).
extern "C" __global__ void wrk_radix_count(const wrk_u64* keys, unsigned shift, wrk_u32* counts, wrk_i64 n) {
    WRK_RADIX_RUN_COUNTS(packed, keys, shift, n)
    WRK_RADIX_BLOCK_PREFIX(packed, prefix, total)
    if (threadIdx.x < WRK_RADIX_DIGITS) counts[(wrk_i64)threadIdx.x * gridDim.x + blockIdx.x] = total[threadIdx.x];
}

// Moves each (key, row) pair to its place by the digit at `shift`: `offsets` is the exclusive
// prefix sum of wrk_radix_count's counts (the place of tile b's first key of digit d). The tile
// is loaded into shared memory (coalesced), each thread places its run's pairs there in digit
// order, and the block writes them out in that order, so that consecutive threads write
// consecutive places of one digit's run.
extern "C" __global__ void wrk_radix_scatter(const wrk_u64* keys, const wrk_u32* rows, unsigned shift,
                                             const wrk_u32* offsets, wrk_u64* keys_out, wrk_u32* rows_out,
                                             wrk_i64 n) {
    __shared__ wrk_u64 tile_keys[WRK_RADIX_TILE];
    __shared__ wrk_u32 tile_rows[WRK_RADIX_TILE];
    __shared__ wrk_u32 digit_start[WRK_RADIX_DIGITS];
    const wrk_i64 base = (wrk_i64)blockIdx.x * WRK_RADIX_TILE;
    const int tile_len = (int)(n - base < WRK_RADIX_TILE ? n - base : WRK_RADIX_TILE);
    for (int j = threadIdx.x; j < tile_len; j += blockDim.x) {
        tile_keys[j] = keys[base + j];
        tile_rows[j] = rows[base + j];
    }
    __syncthreads();
    // This thread's run, from shared memory into registers, and its digit counts.
    wrk_u64 run_keys[WRK_RADIX_ITEMS];
    wrk_u32 run_rows[WRK_RADIX_ITEMS];
    wrk_u64 packed = 0ULL;
    const int first = threadIdx.x * WRK_RADIX_ITEMS;
    for (int j = 0; j < WRK_RADIX_ITEMS; j++) {
        if (first + j < tile_len) {
            run_keys[j] = tile_keys[first + j];
            run_rows[j] = tile_rows[first + j];
            packed += 1ULL << (4 * WRK_RADIX_DIGIT(run_keys[j], shift));
        }
    }
    WRK_RADIX_BLOCK_PREFIX(packed, prefix, total)
    if (threadIdx.x == 0) {
        wrk_u32 sum = 0;
        for (int d = 0; d < WRK_RADIX_DIGITS; d++) {
            digit_start[d] = sum;
            sum += total[d];
        }
    }
    __syncthreads();
    wrk_u64 seen = 0ULL;
    for (int j = 0; j < WRK_RADIX_ITEMS; j++) {
        if (first + j < tile_len) {
            const unsigned d = WRK_RADIX_DIGIT(run_keys[j], shift);
            const wrk_u32 at = digit_start[d] + prefix[d][threadIdx.x] + (wrk_u32)((seen >> (4 * d)) & 15ULL);
            seen += 1ULL << (4 * d);
            tile_keys[at] = run_keys[j];
            tile_rows[at] = run_rows[j];
        }
    }
    __syncthreads();
    for (int j = threadIdx.x; j < tile_len; j += blockDim.x) {
        const wrk_u64 key = tile_keys[j];
        const unsigned d = WRK_RADIX_DIGIT(key, shift);
        const wrk_u32 at = offsets[(wrk_i64)d * gridDim.x + blockIdx.x] + ((wrk_u32)j - digit_start[d]);
        keys_out[at] = key;
        rows_out[at] = tile_rows[j];
    }
}

// ---------------------------------------------------------------------------------------------
// Hash group-by on one key word: open addressing with linear probing; a slot is claimed with
// atomicCAS (0 empty, 1 being written, 2 ready). Needs independent thread scheduling (sm_70+):
// a thread may wait on a slot its warp neighbour is writing.
// ---------------------------------------------------------------------------------------------

WRK_HD wrk_u64 wrk_slot_of(wrk_u64 word, wrk_u64 mask) { return wrk_mix(word) & mask; }

// Each row's slot (null keys share slot mask + 1), and each slot's first row (atomicMin; the
// caller fills first_row with WRK_NONE).
extern "C" __global__ void wrk_group_insert(const wrk_u64* words, const wrk_u8* valid, wrk_u64* slot_words,
                                            int* slot_state, wrk_u32* first_row, wrk_u32* row_slot,
                                            wrk_u64 mask, wrk_i64 n) {
    WRK_ROWS(i, n) {
        wrk_u64 slot;
        if (!WRK_VALID(valid, i)) {
            slot = mask + 1;
        } else {
            wrk_u64 k = words[i];
            slot = wrk_slot_of(k, mask);
            while (true) {
                // A slot already claimed is read, not claimed again: with few groups nearly
                // every row finds its group's slot filled, and atomics on those few slots
                // would serialise.
                int state = ((volatile int*)slot_state)[slot];
                if (state == 0) state = atomicCAS(&slot_state[slot], 0, 1);
                if (state == 0) {
                    ((volatile wrk_u64*)slot_words)[slot] = k;
                    __threadfence();
                    atomicExch(&slot_state[slot], 2);
                    break;
                }
                while (state == 1) state = atomicAdd(&slot_state[slot], 0);
                __threadfence();
                if (((volatile wrk_u64*)slot_words)[slot] == k) break;
                slot = (slot + 1) & mask;
            }
        }
        row_slot[i] = (wrk_u32)slot;
        // First rows only go down: a row after the slot's first row so far changes nothing.
        if ((wrk_u32)i < ((volatile wrk_u32*)first_row)[slot]) atomicMin(&first_row[slot], (wrk_u32)i);
    }
}

// 1 for slots that hold a group.
extern "C" __global__ void wrk_used_slots(const wrk_u32* first_row, wrk_u32* flags, wrk_i64 slots) {
    WRK_ROWS(s, slots) { flags[s] = first_row[s] != WRK_NONE ? 1u : 0u; }
}

// The first row of each used slot, as an order word (groups are numbered by first occurrence).
extern "C" __global__ void wrk_slot_first_rows(const wrk_u32* used_slots, const wrk_u32* first_row, wrk_u64* words,
                                               wrk_i64 groups) {
    WRK_ROWS(g, groups) { words[g] = (wrk_u64)first_row[used_slots[g]]; }
}

// group_of_slot[used_slots[order[g]]] = g, and the group's first row.
extern "C" __global__ void wrk_number_groups(const wrk_u32* used_slots, const wrk_u32* order, const wrk_u32* first_row,
                                             wrk_u32* group_of_slot, wrk_u32* group_first_row, wrk_i64 groups) {
    WRK_ROWS(g, groups) {
        wrk_u32 slot = used_slots[order[g]];
        group_of_slot[slot] = (wrk_u32)g;
        group_first_row[g] = first_row[slot];
    }
}

// One word per row from its group so far and its group by the next key: distinct pairs make
// distinct words (both counts are below 2^32).
extern "C" __global__ void wrk_combine_groups(const wrk_u32* group, wrk_u64 next_groups, const wrk_u32* next_group,
                                              wrk_u64* words, wrk_i64 n) {
    WRK_ROWS(i, n) { words[i] = (wrk_u64)group[i] * next_groups + (wrk_u64)next_group[i]; }
}

// acc[i] stays 1 only where valid[i] is 1 too (a row of a join on several keys is null when
// any of its keys is).
extern "C" __global__ void wrk_valid_and(const wrk_u8* valid, wrk_u8* acc, wrk_i64 n) {
    WRK_ROWS(i, n) { acc[i] = (acc[i] != 0 && valid[i] != 0) ? 1 : 0; }
}

extern "C" __global__ void wrk_row_groups(const wrk_u32* row_slot, const wrk_u32* group_of_slot, wrk_u32* row_group,
                                          wrk_i64 n) {
    WRK_ROWS(i, n) { row_group[i] = group_of_slot[row_slot[i]]; }
}

// Aggregates with atomics. Counts of valid values; sums wrap for integers (as wrapping_add);
// min/max of floats start from NaN and use fmin/fmax (NaN only when every value is NaN, as
// f64::min folds); the caller nulls groups whose count is 0.
#define WRK_ROW_VALID(i) WRK_VALID(valid, i)
#define WRK_ROW_GROUP(i) row_group[i]
#define WRK_ROW_VALUE(i) values[i]
#define WRK_ONE_ULL(i) 1ULL
extern "C" __global__ void wrk_agg_count(const wrk_u8* valid, const wrk_u32* row_group, wrk_u64* counts, wrk_i64 n,
                                         wrk_i64 groups) {
    WRK_ACCUMULATE(wrk_u64, counts, groups, 0ULL, WRK_ROW_VALID, WRK_ROW_GROUP, WRK_ONE_ULL, atomicAdd, WRK_PLUS)
}

WRK_HD void wrk_atomic_fmin(double* at, double v) {
    wrk_u64* bits = (wrk_u64*)at;
    wrk_u64 old = *bits, assumed;
    do {
        assumed = old;
        double next = fmin(__longlong_as_double((long long)assumed), v);
        old = atomicCAS(bits, assumed, (wrk_u64)__double_as_longlong(next));
    } while (assumed != old);
}

WRK_HD void wrk_atomic_fmax(double* at, double v) {
    wrk_u64* bits = (wrk_u64*)at;
    wrk_u64 old = *bits, assumed;
    do {
        assumed = old;
        double next = fmax(__longlong_as_double((long long)assumed), v);
        old = atomicCAS(bits, assumed, (wrk_u64)__double_as_longlong(next));
    } while (assumed != old);
}

#define WRK_AGG_KERNELS(suffix, T, WIDE, ACC)                                                         \
    extern "C" __global__ void wrk_agg_sum_##suffix(const T* values, const wrk_u8* valid, const wrk_u32* row_group, \
                                                    ACC* sums, wrk_i64 n, wrk_i64 groups) {          \
        WRK_ACCUMULATE(WIDE, (WIDE*)sums, groups, (WIDE)0, WRK_ROW_VALID, WRK_ROW_GROUP, WRK_ROW_VALUE, \
                       atomicAdd, WRK_PLUS)                                                           \
    }
// Integer sums add as unsigned 64-bit (wrapping); float sums as double.
WRK_AGG_KERNELS(i8, signed char, unsigned long long, long long)
WRK_AGG_KERNELS(i16, short, unsigned long long, long long)
WRK_AGG_KERNELS(i32, int, unsigned long long, long long)
WRK_AGG_KERNELS(i64, long long, unsigned long long, long long)
WRK_AGG_KERNELS(u8, unsigned char, unsigned long long, unsigned long long)
WRK_AGG_KERNELS(u16, unsigned short, unsigned long long, unsigned long long)
WRK_AGG_KERNELS(u32, unsigned int, unsigned long long, unsigned long long)
WRK_AGG_KERNELS(u64, unsigned long long, unsigned long long, unsigned long long)
WRK_AGG_KERNELS(f32, float, double, double)
WRK_AGG_KERNELS(f64, double, double, double)

// An accumulator's start from its bits (as the host fills the global accumulators).
WRK_HD void wrk_from_bits(wrk_u64 bits, long long* v) { *v = (long long)bits; }
WRK_HD void wrk_from_bits(wrk_u64 bits, unsigned long long* v) { *v = bits; }
WRK_HD void wrk_from_bits(wrk_u64 bits, double* v) { *v = __longlong_as_double((long long)bits); }

// `identity` is the accumulators' start (the neutral value of the minimum or maximum), as bits.
#define WRK_MINMAX_KERNELS(suffix, T, ACC, MIN, MAX, LESSER, GREATER)                                  \
    extern "C" __global__ void wrk_agg_min_##suffix(const T* values, const wrk_u8* valid, const wrk_u32* row_group, \
                                                    ACC* acc, wrk_i64 n, wrk_i64 groups, wrk_u64 identity) { \
        ACC start;                                                                                     \
        wrk_from_bits(identity, &start);                                                               \
        WRK_ACCUMULATE(ACC, acc, groups, start, WRK_ROW_VALID, WRK_ROW_GROUP, WRK_ROW_VALUE, MIN, LESSER) \
    }                                                                                                  \
    extern "C" __global__ void wrk_agg_max_##suffix(const T* values, const wrk_u8* valid, const wrk_u32* row_group, \
                                                    ACC* acc, wrk_i64 n, wrk_i64 groups, wrk_u64 identity) { \
        ACC start;                                                                                     \
        wrk_from_bits(identity, &start);                                                               \
        WRK_ACCUMULATE(ACC, acc, groups, start, WRK_ROW_VALID, WRK_ROW_GROUP, WRK_ROW_VALUE, MAX, GREATER) \
    }
#define WRK_INT_MINMAX(suffix, T, ACC) WRK_MINMAX_KERNELS(suffix, T, ACC, atomicMin, atomicMax, WRK_LESSER, WRK_GREATER)
WRK_INT_MINMAX(i8, signed char, long long)
WRK_INT_MINMAX(i16, short, long long)
WRK_INT_MINMAX(i32, int, long long)
WRK_INT_MINMAX(i64, long long, long long)
WRK_INT_MINMAX(u8, unsigned char, unsigned long long)
WRK_INT_MINMAX(u16, unsigned short, unsigned long long)
WRK_INT_MINMAX(u32, unsigned int, unsigned long long)
WRK_INT_MINMAX(u64, unsigned long long, unsigned long long)
WRK_MINMAX_KERNELS(f32, float, double, wrk_atomic_fmin, wrk_atomic_fmax, fmin, fmax)
WRK_MINMAX_KERNELS(f64, double, double, wrk_atomic_fmin, wrk_atomic_fmax, fmin, fmax)

// Count-distinct: each (group, value) pair, by its first row, counts one for its group when the
// value is valid.
extern "C" __global__ void wrk_count_distinct(const wrk_u32* pair_first_row, const wrk_u8* valid,
                                              const wrk_u32* row_group, wrk_u64* counts, wrk_i64 pairs) {
    WRK_ROWS(p, pairs) {
        wrk_u32 r = pair_first_row[p];
        if (WRK_VALID(valid, r)) atomicAdd(&counts[row_group[r]], 1ULL);
    }
}

// Initial accumulators.
extern "C" __global__ void wrk_fill_u64(wrk_u64* dst, wrk_u64 value, wrk_i64 n) {
    WRK_ROWS(i, n) { dst[i] = value; }
}

// Validity of aggregates: valid where the group had a valid value.
extern "C" __global__ void wrk_count_valid(const wrk_u64* counts, wrk_u8* valid, wrk_i64 groups) {
    WRK_ROWS(g, groups) { valid[g] = counts[g] > 0 ? 1 : 0; }
}

// Mean = sum / count (null where count is 0); counts as Int64 values.
extern "C" __global__ void wrk_agg_mean(const double* sums, const wrk_u64* counts, double* means, wrk_u8* valid,
                                        wrk_i64 groups) {
    WRK_ROWS(g, groups) {
        wrk_u64 c = counts[g];
        means[g] = c > 0 ? sums[g] / (double)c : 0.0;
        valid[g] = c > 0 ? 1 : 0;
    }
}

// Narrows min/max accumulators back to the input type's width (the values fit: they are inputs).
#define WRK_NARROW_KERNEL(name, ACC, T)                                                   \
    extern "C" __global__ void name(const ACC* acc, T* dst, wrk_i64 groups) {             \
        WRK_ROWS(g, groups) { dst[g] = (T)acc[g]; }                                       \
    }
WRK_NARROW_KERNEL(wrk_narrow_i8, long long, signed char)
WRK_NARROW_KERNEL(wrk_narrow_i16, long long, short)
WRK_NARROW_KERNEL(wrk_narrow_i32, long long, int)
WRK_NARROW_KERNEL(wrk_narrow_u8, unsigned long long, unsigned char)
WRK_NARROW_KERNEL(wrk_narrow_u16, unsigned long long, unsigned short)
WRK_NARROW_KERNEL(wrk_narrow_u32, unsigned long long, unsigned int)
WRK_NARROW_KERNEL(wrk_narrow_f32, double, float)

// ---------------------------------------------------------------------------------------------
// Hash join on one key word. Build: the build side's valid rows stably sorted by word (so equal
// keys form runs in table order), each run's word inserted once. Probe: each probe row's run.
// ---------------------------------------------------------------------------------------------

// 1 where a sorted word starts a run.
extern "C" __global__ void wrk_run_starts(const wrk_u64* words, const wrk_u32* order, wrk_u32* flags, wrk_i64 n) {
    WRK_ROWS(i, n) { flags[i] = (i == 0 || words[order[i]] != words[order[i - 1]]) ? 1u : 0u; }
}

extern "C" __global__ void wrk_join_build(const wrk_u64* words, const wrk_u32* order, const wrk_u32* run_starts,
                                          wrk_u64* slot_words, wrk_u32* slot_run, int* slot_state, wrk_u64 mask,
                                          wrk_i64 runs) {
    WRK_ROWS(r, runs) {
        wrk_u64 k = words[order[run_starts[r]]];
        wrk_u64 slot = wrk_slot_of(k, mask);
        while (atomicCAS(&slot_state[slot], 0, 1) != 0) slot = (slot + 1) & mask;
        slot_words[slot] = k;
        slot_run[slot] = (wrk_u32)r;
    }
}

// Each probe row's matching run (start in the sorted build rows, and length); count 0 when none.
extern "C" __global__ void wrk_join_probe(const wrk_u64* words, const wrk_u8* valid, const wrk_u64* slot_words,
                                          const wrk_u32* slot_run, const int* slot_state, wrk_u64 mask,
                                          const wrk_u32* run_starts, wrk_u64 runs, wrk_u32 build_rows,
                                          wrk_u32* match_start, wrk_u32* match_count, wrk_i64 n) {
    WRK_ROWS(i, n) {
        wrk_u32 start = 0, count = 0;
        if (WRK_VALID(valid, i)) {
            wrk_u64 k = words[i];
            wrk_u64 slot = wrk_slot_of(k, mask);
            while (slot_state[slot] != 0) {
                if (slot_words[slot] == k) {
                    wrk_u32 r = slot_run[slot];
                    start = run_starts[r];
                    wrk_u32 end = r + 1 < runs ? run_starts[r + 1] : build_rows;
                    count = end - start;
                    break;
                }
                slot = (slot + 1) & mask;
            }
        }
        match_start[i] = start;
        match_count[i] = count;
    }
}

// Output rows per probe row: its matches, or 1 for an unmatched row of a left join.
extern "C" __global__ void wrk_join_out_counts(const wrk_u32* match_count, int keep_unmatched, wrk_u32* out_counts,
                                               wrk_i64 n) {
    WRK_ROWS(i, n) {
        wrk_u32 c = match_count[i];
        out_counts[i] = (c == 0 && keep_unmatched) ? 1u : c;
    }
}

// Writes the (probe row, build row) pairs at the scanned positions; build rows come from the
// sorted order, so matches of one probe row keep the build table's order.
extern "C" __global__ void wrk_join_emit(const wrk_u32* match_start, const wrk_u32* match_count,
                                         const wrk_u32* out_pos, const wrk_u32* build_order, int keep_unmatched,
                                         wrk_u32* probe_rows, wrk_u32* build_rows, wrk_i64 n) {
    WRK_ROWS(i, n) {
        wrk_u32 at = out_pos[i], c = match_count[i];
        if (c == 0 && keep_unmatched) {
            probe_rows[at] = (wrk_u32)i;
            build_rows[at] = WRK_NONE;
        }
        for (wrk_u32 j = 0; j < c; j++) {
            probe_rows[at + j] = (wrk_u32)i;
            build_rows[at + j] = build_order[match_start[i] + j];
        }
    }
}

// 1 where a probe row has (semi) or has no (anti) match.
extern "C" __global__ void wrk_match_flags(const wrk_u32* match_count, int want_match, wrk_u32* flags, wrk_i64 n) {
    WRK_ROWS(i, n) { flags[i] = ((match_count[i] > 0) == (want_match != 0)) ? 1u : 0u; }
}

#endif
