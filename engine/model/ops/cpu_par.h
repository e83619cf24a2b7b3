/* nextn CPU kernels: a fork-join over up to two threads (cpu_par.c). A kernel hands `nextn_par_` a number of
 * independent items (rows of a token step, column blocks of a GEMM) and a function that computes one item; each
 * item is computed by the same code whichever thread runs it, so how the items are shared never changes a bit. */
#ifndef NEXTN_CPU_PAR_H
#define NEXTN_CPU_PAR_H

#include <stdint.h>

typedef void (*nextn_par_fn)(void *arg, int64_t item);

/* f(arg, i) for every i < n, each exactly once, and returns when all are done: on this thread alone when the pool
 * has one thread, n < 2 or work (the caller's estimate of the whole job, in multiply-adds) < nextn_par_min_work;
 * otherwise this thread and the helper take items one at a time until none is left. */
void nextn_par_(nextn_par_fn f, void *arg, int64_t n, int64_t work);

/* 2^19 (~15 us of GEMM): smaller jobs stay on one thread, so a lone stream's step (M <= K+1 rows) wakes the
 * helper for its LM head only, while a batch's GEMMs, GDN and attention rows split (bench/RESULTS.md) */
extern int64_t nextn_par_min_work;

#endif
