/* The store patterns behind the CPU fused copies' streaming-store choice, in plain C.
 *
 *   gcc -O2 -fopenmp -o /tmp/store_patterns benchmarks/store_patterns.c
 *   OMP_NUM_THREADS=2 /tmp/store_patterns 8192 1024     # tensors, fp32 elements each
 *
 * Every pattern copies tensors * elements fp32 values; time is the best of 30, each printed
 * as a ratio to the first row (a contiguous copy in 256 KiB memcpy pieces, as the fused
 * kernels' cached path does). "cached" rows use memcpy, "streaming" rows non-temporal SSE2
 * stores. fill: from one separate allocation per tensor (a gradient bucket). gather: world
 * 2, each tensor the concatenation of its two halves, taken from two rank streams (the
 * ZeRO-3 copy-out). Three rounds, one line each.
 */
#include <emmintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

/* dst 16-byte aligned here (page-aligned buffers, pieces of 16-byte multiples). */
static void stream_copy(char* dst, const char* src, size_t n) {
  size_t k = 0;
  for (; k + 16 <= n; k += 16) {
    _mm_stream_si128((__m128i*)(dst + k), _mm_loadu_si128((const __m128i*)(src + k)));
  }
  memcpy(dst + k, src + k, n - k);
}

typedef void (*copy_fn)(char*, const char*, size_t);
static void cached_copy(char* dst, const char* src, size_t n) { memcpy(dst, src, n); }

enum { PIECE = 256 * 1024, PATTERNS = 6 };

int main(int argc, char** argv) {
  if (argc != 3) {
    fprintf(stderr, "usage: %s TENSORS ELEMENTS\n", argv[0]);
    return 2;
  }
  const size_t count = strtoul(argv[1], NULL, 10), numel = strtoul(argv[2], NULL, 10);
  const size_t bytes = numel * 4, total = count * bytes, half = bytes / 2;
  char* flat = aligned_alloc(4096, total);
  char* out = aligned_alloc(4096, total);
  char** sources = malloc(count * sizeof(char*));
  for (size_t i = 0; i < count; i++) {
    sources[i] = malloc(bytes);
    memset(sources[i], 1, bytes);
  }
  memset(flat, 1, total);
  memset(out, 0, total);
  const char* names[PATTERNS] = {"contiguous cached", "contiguous streaming", "fill cached",
                                 "fill streaming", "gather cached", "gather streaming"};
  printf("%zu x %zu fp32 (%zu MiB), %d threads\n", count, numel, total >> 20, omp_get_max_threads());
  for (int round = 0; round < 3; round++) {
    double best[PATTERNS];
    for (int p = 0; p < PATTERNS; p++) best[p] = 1e9;
    for (int it = 0; it < 30; it++) {
      for (int p = 0; p < PATTERNS; p++) {
        const copy_fn copy = (p % 2) ? stream_copy : cached_copy;
        double t = now();
        if (p < 2) {
#pragma omp parallel for schedule(static)
          for (size_t at = 0; at < total; at += PIECE) {
            copy(out + at, flat + at, PIECE < total - at ? PIECE : total - at);
          }
        } else if (p < 4) {
#pragma omp parallel for schedule(static)
          for (size_t i = 0; i < count; i++) copy(out + i * bytes, sources[i], bytes);
        } else {
#pragma omp parallel for schedule(static)
          for (size_t i = 0; i < count; i++) {
            copy(out + i * bytes, flat + i * half, half);                        /* rank 0 */
            copy(out + i * bytes + half, flat + total / 2 + i * half, half);     /* rank 1 */
          }
        }
        _mm_sfence();
        t = now() - t;
        if (t < best[p]) best[p] = t;
      }
    }
    for (int p = 0; p < PATTERNS; p++) {
      printf("%s %.3f ms (%.2fx)%s", names[p], best[p] * 1e3, best[p] / best[0],
             p + 1 < PATTERNS ? " | " : "\n");
    }
  }
  return 0;
}
