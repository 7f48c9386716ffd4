// Batch LZ4 (block format) compress and decompress of 4 KiB pages, one 32-lane warp per page,
// four pages per 128-thread block.
//
// This file is the source of kernels/lz4.ptx: `scripts/gen-ptx.sh` compiles it with NVRTC
// (compute_75) and `scripts/gen-ptx.sh --check` proves the committed PTX is its output.
// `src/gpu/model.rs` is the CPU model of these kernels, written step for step beside this file
// (same rounds, same lanes, same hash, same parse, same encode); tests check the model's output
// against the reference LZ4 decoder and, on a GPU, this kernel's output against the model's.

#define PAGE_SIZE 4096u
#define WARP 32u
#define PAGES_PER_BLOCK 4u
#define HASH_BITS 12u
#define HASH_SIZE (1u << HASH_BITS)
#define NO_POS 0xFFFFu
#define MIN_MATCH 4u
// Standard LZ4 block rules: a match starts at most 12 bytes before the end, the last 5 bytes
// are literals.
#define LAST_MATCH_START (PAGE_SIZE - 12u)
#define MATCH_END_LIMIT (PAGE_SIZE - 5u)
#define FULL_MASK 0xFFFFFFFFu

// Compress results in out_lens[] besides a length.
#define LEN_RAW 0xFFFFFFFFu
// Decompress statuses.
#define STATUS_OK 0u
#define STATUS_CORRUPT 1u
// A page that decodes to `n` bytes instead of 4096 reports STATUS_WRONG_LENGTH | n.
#define STATUS_WRONG_LENGTH 0x80000000u

__device__ __forceinline__ unsigned int read32(const unsigned char *p, unsigned int pos) {
    return (unsigned int)p[pos] | ((unsigned int)p[pos + 1] << 8) |
           ((unsigned int)p[pos + 2] << 16) | ((unsigned int)p[pos + 3] << 24);
}

__device__ __forceinline__ unsigned int hash4(unsigned int v) {
    return (v * 2654435761u) >> (32u - HASH_BITS);
}

// Bytes taken by the 255-run that extends a 4-bit length field holding `len`.
__device__ __forceinline__ unsigned int ext_bytes(unsigned int len) {
    return len >= 15u ? (len - 15u) / 255u + 1u : 0u;
}

// Writes the 255-run extending a length field (lane 0 only); returns the new output position.
__device__ __forceinline__ unsigned int write_ext(unsigned char *out, unsigned int op,
                                                  unsigned int len) {
    if (len < 15u) return op;
    unsigned int rest = len - 15u;
    while (rest >= 255u) {
        out[op++] = 255u;
        rest -= 255u;
    }
    out[op++] = (unsigned char)rest;
    return op;
}

// One sequence: `lit` literals from page[anchor..], then (if has_match) a match of `mlen` at
// distance `off`. Every lane computes the same positions; lane 0 writes the token, length bytes
// and offset, the warp copies the literals. Returns the new output position, or LEN_RAW when the
// sequence would pass `max_out`.
__device__ unsigned int emit_sequence(const unsigned char *page, unsigned char *out,
                                      unsigned int op, unsigned int max_out, unsigned int lane,
                                      unsigned int anchor, unsigned int lit, bool has_match,
                                      unsigned int off, unsigned int mlen) {
    unsigned int mcode = has_match ? mlen - MIN_MATCH : 0u;
    unsigned int size = 1u + ext_bytes(lit) + lit + (has_match ? 2u + ext_bytes(mcode) : 0u);
    if (op + size > max_out) return LEN_RAW;
    unsigned int lit_start = 1u + ext_bytes(lit) + op;
    if (lane == 0u) {
        unsigned int token = ((lit < 15u ? lit : 15u) << 4) | (mcode < 15u ? mcode : 15u);
        out[op] = (unsigned char)token;
        write_ext(out, op + 1u, lit);
    }
    for (unsigned int j = lane; j < lit; j += WARP) out[lit_start + j] = page[anchor + j];
    unsigned int mp = lit_start + lit;
    if (has_match && lane == 0u) {
        out[mp] = (unsigned char)(off & 0xFFu);
        out[mp + 1u] = (unsigned char)(off >> 8);
        write_ext(out, mp + 2u, mcode);
    }
    return op + size;
}

// pages: n_pages * 4096 bytes; out: n_pages slots of 4096 bytes; out_lens[i]: the LZ4 length
// of page i (at most max_out, which must be <= 4096), or LEN_RAW when it would not fit.
extern "C" __global__ void __launch_bounds__(128) lz4_compress_pages(
    const uint4 *__restrict__ pages, unsigned char *__restrict__ out,
    unsigned int *__restrict__ out_lens, unsigned int n_pages, unsigned int max_out) {
    __shared__ uint4 s_pages[PAGES_PER_BLOCK][PAGE_SIZE / 16u];
    __shared__ unsigned short s_tables[PAGES_PER_BLOCK][HASH_SIZE];

    const unsigned int warp = threadIdx.x / WARP;
    const unsigned int lane = threadIdx.x % WARP;
    const unsigned int page_index = blockIdx.x * PAGES_PER_BLOCK + warp;
    if (page_index >= n_pages) return;  // whole warp leaves together

    // Step 1: load the page (16-byte loads, 8 per lane) and empty the hash table.
    const uint4 *src = pages + (size_t)page_index * (PAGE_SIZE / 16u);
    for (unsigned int i = lane; i < PAGE_SIZE / 16u; i += WARP) s_pages[warp][i] = src[i];
    unsigned int *table_words = (unsigned int *)s_tables[warp];
    for (unsigned int i = lane; i < HASH_SIZE / 2u; i += WARP) table_words[i] = 0xFFFFFFFFu;
    __syncwarp();
    const unsigned char *page = (const unsigned char *)s_pages[warp];
    unsigned short *table = s_tables[warp];
    unsigned char *dst = out + (size_t)page_index * PAGE_SIZE;

    // Candidates of the two most recent rounds: lane i holds position round_base-64+i (prev)
    // and round_base-32+i (cur).
    unsigned int cand_prev = NO_POS, cand_cur = NO_POS;
    unsigned int round_base = 0u;

    unsigned int p = 0u, anchor = 0u, op = 0u;
    while (p <= LAST_MATCH_START) {
        // Step 2: candidates, one round of 32 consecutive positions at a time, until the window
        // [p, p+32) is covered. A lane's candidate is the most recent earlier position with
        // its hash: the highest lower lane of this round with that hash, else the table.
        unsigned int need = min(p + WARP, LAST_MATCH_START + 1u);
        while (round_base < need) {
            unsigned int pos = round_base + lane;
            bool valid = pos <= LAST_MATCH_START;
            unsigned int h = valid ? hash4(read32(page, pos)) : 0u;
            unsigned int key = valid ? h : (0x80000000u | lane);
            unsigned int peers = __match_any_sync(FULL_MASK, key);
            unsigned int lower = peers & ((1u << lane) - 1u);
            unsigned int cand = NO_POS;
            if (valid) cand = lower ? round_base + (31u - __clz(lower)) : table[h];
            __syncwarp();
            bool highest = (peers >> lane) == 1u;
            if (valid && highest) table[h] = (unsigned short)pos;
            __syncwarp();
            cand_prev = cand_cur;
            cand_cur = cand;
            round_base += WARP;
        }

        // Step 3: the first position of the window whose candidate really matches (4 bytes).
        unsigned int q = p + lane;
        unsigned int from_lane = q % WARP;
        unsigned int c_prev = __shfl_sync(FULL_MASK, cand_prev, from_lane);
        unsigned int c_cur = __shfl_sync(FULL_MASK, cand_cur, from_lane);
        unsigned int c = q >= round_base - WARP ? c_cur : c_prev;
        bool hit = q <= LAST_MATCH_START && c != NO_POS && read32(page, q) == read32(page, c);
        unsigned int hits = __ballot_sync(FULL_MASK, hit);
        if (hits == 0u) {
            p += WARP;
            continue;
        }
        unsigned int first = __ffs(hits) - 1u;
        unsigned int mstart = p + first;
        unsigned int mref = __shfl_sync(FULL_MASK, c, first);

        // Step 4: extend the match forward, 32 bytes per step, up to the last-literals limit.
        unsigned int limit = MATCH_END_LIMIT - mstart;
        unsigned int mlen = MIN_MATCH;
        for (unsigned int k = MIN_MATCH;; k += WARP) {
            unsigned int j = k + lane;
            bool same = j < limit && page[mstart + j] == page[mref + j];
            unsigned int differ = __ballot_sync(FULL_MASK, !same);
            if (differ) {
                mlen = k + __ffs(differ) - 1u;
                break;
            }
        }
        // ... and backward over the pending literals.
        while (mstart > anchor && mref > 0u && page[mstart - 1u] == page[mref - 1u]) {
            mstart--;
            mref--;
            mlen++;
        }

        // Step 5: encode literals [anchor, mstart) and the match.
        op = emit_sequence(page, dst, op, max_out, lane, anchor, mstart - anchor, true,
                           mstart - mref, mlen);
        if (op == LEN_RAW) break;
        p = mstart + mlen;
        anchor = p;
    }
    if (op != LEN_RAW)
        op = emit_sequence(page, dst, op, max_out, lane, anchor, PAGE_SIZE - anchor, false, 0u,
                           0u);
    if (lane == 0u) out_lens[page_index] = op;
}

// inputs: the compressed pages packed back to back, page i at in_offsets[i] with in_lens[i]
// bytes (at most 4096); out: n_pages pages of 4096 bytes (written only where the page decoded);
// status[i]: STATUS_*.
extern "C" __global__ void __launch_bounds__(128) lz4_decompress_pages(
    const unsigned char *__restrict__ inputs, const unsigned int *__restrict__ in_offsets,
    const unsigned int *__restrict__ in_lens, uint4 *__restrict__ out,
    unsigned int *__restrict__ status, unsigned int n_pages) {
    __shared__ unsigned char s_in[PAGES_PER_BLOCK][PAGE_SIZE];
    __shared__ uint4 s_out[PAGES_PER_BLOCK][PAGE_SIZE / 16u];

    const unsigned int warp = threadIdx.x / WARP;
    const unsigned int lane = threadIdx.x % WARP;
    const unsigned int page_index = blockIdx.x * PAGES_PER_BLOCK + warp;
    if (page_index >= n_pages) return;

    const unsigned int in_len = in_lens[page_index];
    if (in_len > PAGE_SIZE) {
        if (lane == 0u) status[page_index] = STATUS_CORRUPT;
        return;
    }
    const unsigned char *src = inputs + in_offsets[page_index];
    unsigned char *in = s_in[warp];
    for (unsigned int i = lane; i < in_len; i += WARP) in[i] = src[i];
    __syncwarp();
    unsigned char *page = (unsigned char *)s_out[warp];

    // Every lane parses the same tokens (broadcast reads); the warp copies each run.
    unsigned int ip = 0u, op = 0u, result = STATUS_OK;
    for (;;) {
        if (ip >= in_len) { result = STATUS_CORRUPT; break; }
        unsigned int token = in[ip++];
        unsigned int lit = token >> 4;
        if (lit == 15u) {
            unsigned int b;
            do {
                if (ip >= in_len) { result = STATUS_CORRUPT; break; }
                b = in[ip++];
                lit += b;
            } while (b == 255u);
            if (result != STATUS_OK) break;
        }
        if (lit > in_len - ip || lit > PAGE_SIZE - op) { result = STATUS_CORRUPT; break; }
        for (unsigned int j = lane; j < lit; j += WARP) page[op + j] = in[ip + j];
        __syncwarp();
        ip += lit;
        op += lit;
        if (ip == in_len) break;  // the last sequence has literals only
        if (in_len - ip < 2u) { result = STATUS_CORRUPT; break; }
        unsigned int off = (unsigned int)in[ip] | ((unsigned int)in[ip + 1u] << 8);
        ip += 2u;
        if (off == 0u || off > op) { result = STATUS_CORRUPT; break; }
        unsigned int mlen = token & 15u;
        if (mlen == 15u) {
            unsigned int b;
            do {
                if (ip >= in_len) { result = STATUS_CORRUPT; break; }
                b = in[ip++];
                mlen += b;
            } while (b == 255u);
            if (result != STATUS_OK) break;
        }
        mlen += MIN_MATCH;
        if (mlen > PAGE_SIZE - op) { result = STATUS_CORRUPT; break; }
        // A match repeats the last `off` bytes: byte j of it is page[op - off + j % off], which
        // is already written, so all lanes copy at once.
        const unsigned int from = op - off;
        for (unsigned int j = lane; j < mlen; j += WARP)
            page[op + j] = page[from + (j < off ? j : j % off)];
        __syncwarp();
        op += mlen;
    }
    if (result == STATUS_OK && op != PAGE_SIZE) result = STATUS_WRONG_LENGTH | op;

    uint4 *dst = out + (size_t)page_index * (PAGE_SIZE / 16u);
    if (result == STATUS_OK)
        for (unsigned int i = lane; i < PAGE_SIZE / 16u; i += WARP) dst[i] = s_out[warp][i];
    if (lane == 0u) status[page_index] = result;
}
