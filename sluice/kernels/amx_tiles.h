/* What every AMX kernel needs: the tile configuration, and the permission Linux gives a
 * process to use the tile registers. Included by qgemm.c and decode_attention.c on the AMX
 * builds; each asks for the permission once. */
#ifndef SLUICE_AMX_TILES_H
#define SLUICE_AMX_TILES_H

#include <immintrin.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* Linux gives a process the tile registers only when it asks (once per process). */
static int amx_permitted(void) {
    static int state; /* 0 not asked, 1 granted, -1 refused */
    int seen = __atomic_load_n(&state, __ATOMIC_ACQUIRE);
    if (seen == 0) {
        seen = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
        __atomic_store_n(&state, seen, __ATOMIC_RELEASE);
    }
    return seen == 1;
}

#ifdef SLUICE_AMX_BF16
/* All eight tiles 16 rows x 64 bytes: C 16 x 16 float32, A 16 rows x 32 bf16, B 16 pairs x
 * 16 columns of bf16 pairs. */
static void configure_bf16_tiles(void) {
    tile_config config = {0};
    config.palette_id = 1;
    for (int t = 0; t < 8; t++) config.rows[t] = 16, config.colsb[t] = 64;
    _tile_loadconfig(&config);
}
#endif

#endif
