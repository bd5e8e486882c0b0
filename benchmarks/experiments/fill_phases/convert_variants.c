/* The CPU fill's bf16 -> fp32 conversion loop against variants of it, in plain C (2026-11-26).
 *
 *   gcc -O2 -fopenmp -o /tmp/convert_variants benchmarks/experiments/fill_phases/convert_variants.c
 *   OMP_NUM_THREADS=2 /tmp/convert_variants
 *
 * 8M bf16 elements into fp32 (16 MiB read, 32 MiB written), split over the threads; before
 * each timed call a 64 MiB buffer is touched to evict the caches; 30 rounds, best and median.
 * "v8 stream (current)" is the loop of csrc/ops/copy_plan_cpu.cpp (8 elements, one 256-bit
 * streaming store); "traffic ref" moves the same bytes without converting.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <stdint.h>
#include <time.h>
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
typedef void (*fn)(const uint16_t*, float*, size_t);
__attribute__((target("avx2"))) static void v8(const uint16_t* s, float* d, size_t n){
  const __m256 f=_mm256_set1_ps(1.0f);
  for(size_t k=0;k<n;k+=8){__m256i w=_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(s+k)));
    _mm256_stream_ps(d+k,_mm256_mul_ps(_mm256_castsi256_ps(_mm256_slli_epi32(w,16)),f));}
}
__attribute__((target("avx2"))) static void v32(const uint16_t* s, float* d, size_t n){
  for(size_t k=0;k<n;k+=32){
    __m128i a=_mm_loadu_si128((const __m128i*)(s+k)),b=_mm_loadu_si128((const __m128i*)(s+k+8)),
            c=_mm_loadu_si128((const __m128i*)(s+k+16)),e=_mm_loadu_si128((const __m128i*)(s+k+24));
    _mm256_stream_si256((__m256i*)(d+k),_mm256_slli_epi32(_mm256_cvtepu16_epi32(a),16));
    _mm256_stream_si256((__m256i*)(d+k+8),_mm256_slli_epi32(_mm256_cvtepu16_epi32(b),16));
    _mm256_stream_si256((__m256i*)(d+k+16),_mm256_slli_epi32(_mm256_cvtepu16_epi32(c),16));
    _mm256_stream_si256((__m256i*)(d+k+24),_mm256_slli_epi32(_mm256_cvtepu16_epi32(e),16));}
}
__attribute__((target("avx2"))) static void v8cached(const uint16_t* s, float* d, size_t n){
  for(size_t k=0;k<n;k+=8){__m256i w=_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(s+k)));
    _mm256_storeu_si256((__m256i*)(d+k),_mm256_slli_epi32(w,16));}
}
__attribute__((target("avx512f,avx512bw"))) static void v16_512(const uint16_t* s, float* d, size_t n){
  for(size_t k=0;k<n;k+=16){__m512i w=_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(s+k)));
    _mm512_stream_si512((__m512i*)(d+k),_mm512_slli_epi32(w,16));}
}
static void f32stream(const uint16_t* s, float* d, size_t n){ /* fp32 copy of n/2 floats... traffic ref: reads n*2 bytes writes n*4 */
  const float* fs=(const float*)s; /* read n/2 floats = 2n bytes */
  for(size_t k=0;k<n/2;k+=4){_mm_stream_ps(d+2*k,_mm_loadu_ps(fs+k));_mm_stream_ps(d+2*k+4,_mm_loadu_ps(fs+k));}
}
int main(int argc,char**argv){
  size_t n=(size_t)8<<20; int tensors=argc>1?atoi(argv[1]):1;
  uint16_t* s=aligned_alloc(4096,n*2); float* d=aligned_alloc(4096,n*4); char* ev=aligned_alloc(4096,64<<20);
  for(size_t i=0;i<n;i++)s[i]=0x3f80+(i&7); memset(d,0,n*4); memset(ev,1,64<<20);
  fn f[]={v8,v32,v8cached,v16_512,f32stream}; const char* nm[]={"v8 stream (current)","v32 stream","v8 cached","v16 avx512 stream","traffic ref"};
  double best[5]={1e9,1e9,1e9,1e9,1e9}; double med[5][30];
  for(int r=0;r<30;r++) for(int m=0;m<5;m++){
    for(size_t i=0;i<(64u<<20);i+=64) ev[i]++;
    double t0=now();
    #pragma omp parallel for schedule(static)
    for(int c=0;c<64;c++){size_t per=n/64; f[m](s+c*per,d+c*per,per);}
    _mm_sfence(); double t=now()-t0; med[m][r]=t; if(t<best[m])best[m]=t;}
  for(int m=0;m<5;m++){double a[30];memcpy(a,med[m],sizeof a);for(int i=0;i<30;i++)for(int j=i+1;j<30;j++)if(a[j]<a[i]){double x=a[i];a[i]=a[j];a[j]=x;}
    printf("%-22s best %.0f us median %.0f us\n",nm[m],best[m]*1e6,a[15]*1e6);}
}
