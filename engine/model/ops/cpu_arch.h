/* nextn CPU kernels: which code the build takes. NEXTN_X86 is 1 when the x86 intrinsics (AVX2 + FMA and AVX-512 GEMM
 * tiles, MXCSR, pause) are compiled in: on x86 unless the build asks for the portable code (-DNEXTN_PORTABLE,
 * engine/model/ops/cpu.py's portable build). With 0 every kernel compiles from plain C and GCC / clang vector
 * extensions alone (aarch64 and any other target), computing the same numbers with the same operations in the
 * same order. */
#ifndef NEXTN_CPU_ARCH_H
#define NEXTN_CPU_ARCH_H

#if (defined(__x86_64__) || defined(__i386__)) && !defined(NEXTN_PORTABLE)
#define NEXTN_X86 1
#else
#define NEXTN_X86 0
#endif

/* the GEMM's 16-lane tiles (cpu_linear.c; run only where the CPU has AVX-512F, checked when they are turned on) */
#define NEXTN_AVX512 NEXTN_X86

#endif
