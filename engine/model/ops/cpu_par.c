/* nextn CPU kernels: the fork-join of cpu_par.h, with one helper thread (started on first use, then kept).
 *
 * A job is published as a ticket, (job id << 32) | (lo << 16) | hi with [lo, hi) the items nobody has claimed yet:
 * the calling thread claims from the front (lo) and the helper from the back (hi), each with a compare-and-swap, so
 * an item is computed once, by whichever thread claims it; the two meet in the middle, so neighbouring items (the
 * column blocks of a GEMM share cache lines of the output) mostly stay on one thread; and a helper that wakes late
 * (or never) only means the calling thread takes more items: the caller never waits for work nobody started. A
 * claim names the job id, so a helper still holding an old job's description can never run it. The description (function, argument,
 * count) is written and read under a mutex. Between jobs the helper spins for SPIN_NS (a step forward issues its
 * kernels tens of microseconds apart), then sleeps on a condition variable.
 *
 * The helper computes each job under the caller's floating-point environment (MXCSR on x86, <fenv.h>'s elsewhere:
 * flush-to-zero and denormals-are-zero change results), so an item's bits never depend on the thread that took it.
 *
 * `nextn_set_threads(1)` (the default) keeps every kernel on the calling thread. A second caller that finds the
 * helper in use runs its whole job itself. A child forked from a process with a helper starts without one
 * (pthread_atfork), so nothing ever waits on a thread that does not exist. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>

#include "cpu_arch.h"
#include "cpu_par.h"

#if NEXTN_X86
#include <xmmintrin.h>
typedef unsigned int fpenv_;  /* MXCSR: rounding, flush-to-zero, denormals-are-zero */
static inline fpenv_ fpenv_get_(void) { return _mm_getcsr(); }
static inline void fpenv_set_(fpenv_ e) { _mm_setcsr(e); }
#else
#include <fenv.h>
typedef fenv_t fpenv_;
static inline fpenv_ fpenv_get_(void) { fenv_t e; fegetenv(&e); return e; }
static inline void fpenv_set_(fpenv_ e) { fesetenv(&e); }
#endif

#define SPIN_NS 150000   /* how long an idle thread polls before it sleeps */
#define MAX_ITEMS 0xffff  /* lo and hi are 16 bits each */

int64_t nextn_par_min_work = 1 << 19;
_Atomic int64_t nextn_par_helper_items;  /* items the helper has computed (a diagnostic: tests read it) */

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t go_cv = PTHREAD_COND_INITIALIZER, done_cv = PTHREAD_COND_INITIALIZER;
static atomic_flag in_use = ATOMIC_FLAG_INIT;  /* one caller owns the helper for one job */
static _Atomic uint64_t ticket;                /* (job id << 32) | (lo << 16) | hi: items [lo, hi) unclaimed */
static _Atomic int64_t done;                   /* items of the current job finished */
static _Atomic int threads = 1;
static int started = 0, helper_asleep = 0, caller_asleep = 0, atfork_set = 0;
static uint64_t last_id;                       /* the caller side's job counter */
static nextn_par_fn job_f;                     /* the current job, under mu */
static void *job_arg;
static int64_t job_n;
static fpenv_ job_fpenv;

static int64_t now_ns_(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static inline void relax_(void) {
#if NEXTN_X86
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* claim and run items of job `id` from the front (back: from the back) until none is left or the job is no longer
 * current */
static void work_(uint64_t id, nextn_par_fn f, void *arg, int64_t n, int back) {
    uint64_t t = atomic_load_explicit(&ticket, memory_order_acquire);
    for (;;) {
        const uint64_t lo = (t >> 16) & MAX_ITEMS, hi = t & MAX_ITEMS;
        if ((t >> 32) != id || lo >= hi) return;
        const uint64_t next = back ? t - 1 : t + (1u << 16);
        if (!atomic_compare_exchange_weak_explicit(&ticket, &t, next, memory_order_acq_rel, memory_order_acquire))
            continue;  /* t now holds the current ticket */
        f(arg, (int64_t)(back ? hi - 1 : lo));
        if (back) atomic_fetch_add_explicit(&nextn_par_helper_items, 1, memory_order_relaxed);
        if (atomic_fetch_add_explicit(&done, 1, memory_order_acq_rel) + 1 == n) {
            pthread_mutex_lock(&mu);
            if (caller_asleep) pthread_cond_signal(&done_cv);
            pthread_mutex_unlock(&mu);
        }
        t = atomic_load_explicit(&ticket, memory_order_acquire);
    }
}

static void *helper_(void *unused) {
    (void)unused;
    uint64_t seen = 0;
    for (;;) {
        int64_t t0 = now_ns_();
        for (int i = 0; (atomic_load_explicit(&ticket, memory_order_acquire) >> 32) == seen; i++) {
            relax_();
            if ((i & 63) == 63 && now_ns_() - t0 > SPIN_NS) break;
        }
        pthread_mutex_lock(&mu);
        while ((atomic_load_explicit(&ticket, memory_order_acquire) >> 32) == seen) {
            helper_asleep = 1;
            pthread_cond_wait(&go_cv, &mu);
            helper_asleep = 0;
        }
        seen = atomic_load_explicit(&ticket, memory_order_acquire) >> 32;
        const nextn_par_fn f = job_f;
        void *const arg = job_arg;
        const int64_t n = job_n;
        fpenv_set_(job_fpenv);
        pthread_mutex_unlock(&mu);
        work_(seen, f, arg, n, 1);
    }
    return 0;
}

static void forked_child_(void) {  /* the helper did not survive fork(): start over without one */
    pthread_mutex_init(&mu, 0);
    pthread_cond_init(&go_cv, 0);
    pthread_cond_init(&done_cv, 0);
    /* a job another thread had in flight at the fork is not ours: no item of it may be claimed here */
    atomic_store(&ticket, atomic_load(&ticket) & ~0xffffffffull);
    atomic_store(&done, 0);
    atomic_flag_clear(&in_use);
    started = helper_asleep = caller_asleep = 0;
}

/* 1 or 2 threads for the kernels (more is taken as 2); returns the number in effect */
int nextn_set_threads(int n) {
    threads = n >= 2 ? 2 : 1;
    return threads;
}

static int start_(void) {
    pthread_t t;
    pthread_attr_t at;
    if (!atfork_set) atfork_set = pthread_atfork(0, 0, forked_child_) == 0;
    if (!atfork_set || pthread_attr_init(&at)) return 0;
    pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
    const int ok = pthread_create(&t, &at, helper_, 0) == 0;
    pthread_attr_destroy(&at);
    return ok;
}

void nextn_par_(nextn_par_fn f, void *arg, int64_t n, int64_t work) {
    if (threads < 2 || n < 2 || n > MAX_ITEMS || work < nextn_par_min_work
            || atomic_flag_test_and_set(&in_use)) {
        for (int64_t i = 0; i < n; i++) f(arg, i);
        return;
    }
    if (!started && !(started = start_())) {  /* no helper: this thread does it all, now and later */
        threads = 1;
        atomic_flag_clear(&in_use);
        for (int64_t i = 0; i < n; i++) f(arg, i);
        return;
    }
    const uint64_t id = ++last_id & 0xffffffffull;
    pthread_mutex_lock(&mu);
    job_f = f;
    job_arg = arg;
    job_n = n;
    job_fpenv = fpenv_get_();
    atomic_store_explicit(&done, 0, memory_order_relaxed);
    atomic_store_explicit(&ticket, id << 32 | (uint64_t)n, memory_order_release);
    if (helper_asleep) pthread_cond_signal(&go_cv);
    pthread_mutex_unlock(&mu);
    work_(id, f, arg, n, 0);
    /* every item is claimed: wait for the ones the helper is still computing */
    const int64_t t0 = now_ns_();
    for (int i = 0; atomic_load_explicit(&done, memory_order_acquire) < n; i++) {
        relax_();
        if ((i & 63) == 63 && now_ns_() - t0 > SPIN_NS) {
            pthread_mutex_lock(&mu);
            while (atomic_load_explicit(&done, memory_order_acquire) < n) {
                caller_asleep = 1;
                pthread_cond_wait(&done_cv, &mu);
                caller_asleep = 0;
            }
            pthread_mutex_unlock(&mu);
        }
    }
    atomic_flag_clear(&in_use);
}
