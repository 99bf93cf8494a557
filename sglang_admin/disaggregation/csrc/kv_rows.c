/* A room's KV rows between the pool's layer buffers and one contiguous block, with the
 * CRC-32 of the rows taken in the same pass (disaggregation/kv_rows.py loads it).
 *
 * The pool is `nbuf` buffers; buffer b holds rows of items[b] bytes at bases[b]. A room is
 * `n` rows per buffer: the slots `slots[0..n)`, or, when `slots` is NULL, the run of slots
 * first, first + 1, ...  Its block side is given per buffer (blocks[b]: that buffer's n
 * rows, contiguous), so one gathered frame, one frame per buffer, or a staging region are
 * all the same call. The checksum is the caller's CRC-32 function (zlib's polynomial,
 * crc(previous, bytes, length)), applied to the rows buffer-major in slot order, each piece
 * right after it was copied (it is still in cache), so the sum is of what was written.
 */
#include <stdint.h>
#include <string.h>

typedef uint32_t (*crc_fn)(uint32_t, const uint8_t *, uint64_t);

#define PIECE (128 * 1024) /* bytes copied then summed at a time: they stay in L2 */

static uint32_t copy_sum(uint8_t *dst, const uint8_t *src, uint64_t len, crc_fn crc,
                         uint32_t acc) {
    while (len) {
        uint64_t k = len < PIECE ? len : PIECE;
        memcpy(dst, src, k);
        if (crc) acc = crc(acc, dst, k);
        dst += k;
        src += k;
        len -= k;
    }
    return acc;
}

/* to_block = 1: the pool's rows into the blocks (gather), summing the blocks;
 * to_block = 0: the blocks into the pool's rows (scatter), summing the pool's rows;
 * to_block = 2: no copy, the pool's rows summed (blocks unused). crc NULL: no sum. */
uint32_t kv_rows(int64_t nbuf, const uint64_t *bases, const int64_t *items, int64_t n,
                 const int64_t *slots, int64_t first, uint64_t *blocks, int to_block,
                 crc_fn crc, uint32_t acc) {
    for (int64_t b = 0; b < nbuf; b++) {
        uint8_t *pool = (uint8_t *)(uintptr_t)bases[b];
        uint64_t item = (uint64_t)items[b];
        uint8_t *block = to_block == 2 ? NULL : (uint8_t *)(uintptr_t)blocks[b];
        if (slots == NULL) {
            uint8_t *rows = pool + (uint64_t)first * item;
            if (to_block == 1)
                acc = copy_sum(block, rows, (uint64_t)n * item, crc, acc);
            else if (to_block == 0)
                acc = copy_sum(rows, block, (uint64_t)n * item, crc, acc);
            else if (crc)
                acc = crc(acc, rows, (uint64_t)n * item);
            continue;
        }
        for (int64_t i = 0; i < n; i++) {
            uint8_t *row = pool + (uint64_t)slots[i] * item;
            if (to_block == 1) {
                memcpy(block + (uint64_t)i * item, row, item);
                if (crc) acc = crc(acc, block + (uint64_t)i * item, item);
            } else if (to_block == 0) {
                memcpy(row, block + (uint64_t)i * item, item);
                if (crc) acc = crc(acc, row, item);
            } else if (crc) {
                acc = crc(acc, row, item);
            }
        }
    }
    return acc;
}
