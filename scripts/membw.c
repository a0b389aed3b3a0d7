/* Memory read-bandwidth probe: every thread streams its slice of a large buffer, summing 64-bit words into
 * independent accumulators so the compiler vectorizes the loop with the widest loads the CPU has.
 * Build: cc -O3 -march=native -fopenmp membw.c -o membw    Run: OMP_NUM_THREADS=N ./membw [MiB] [reps] [serve]
 * Prints "read_gbps <best> <median>" on its last line. With "serve" it keeps its buffer and, for every line
 * "<reps>" it reads on stdin, reads the buffer that many times and prints one such line: a probe between two
 * measurements then costs only its reads (allocating and first touching a GiB takes longer than reading it). */
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Reads the buffer reps times (reps <= 1000) and prints the best and median rate. */
static void probe(const uint64_t *buf, size_t words, int reps, double *rates) {
    uint64_t check = 0;
    for (int r = 0; r < reps; r++) {
        double t0 = seconds();
        uint64_t total = 0;
#pragma omp parallel reduction(+ : total)
        {
            uint64_t acc[16];
            memset(acc, 0, sizeof(acc));
#pragma omp for schedule(static)
            for (size_t i = 0; i < words; i += 16)
                for (int j = 0; j < 16; j++) acc[j] += buf[i + j];
            for (int j = 0; j < 16; j++) total += acc[j];
        }
        rates[r] = (double)(words * sizeof(uint64_t)) / (seconds() - t0) / 1e9;
        check += total;
    }
    qsort(rates, (size_t)reps, sizeof(double), cmp_double);
    printf("threads %d buffer_mib %zu check %llu\n", omp_get_max_threads(), (words * sizeof(uint64_t)) >> 20,
           (unsigned long long)(check & 0xff));
    printf("read_gbps %.2f %.2f\n", rates[reps - 1], rates[reps / 2]);
    fflush(stdout);
}

int main(int argc, char **argv) {
    size_t mib = argc > 1 ? strtoul(argv[1], NULL, 10) : 1024;
    int reps = argc > 2 ? atoi(argv[2]) : 9;
    int serve = argc > 3 && strcmp(argv[3], "serve") == 0;
    if (reps < 1 || reps > 1000) reps = 9;
    size_t words = (mib << 20) / sizeof(uint64_t);
    words -= words % 64;
    uint64_t *buf = aligned_alloc(1 << 21, words * sizeof(uint64_t));
    if (!buf) { fprintf(stderr, "membw: cannot allocate %zu MiB\n", mib); return 1; }
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < words; i++) buf[i] = i;
    double rates[1000];
    if (!serve) {
        probe(buf, words, reps, rates);
    } else {
        char line[64];
        while (fgets(line, sizeof(line), stdin)) {
            int n = atoi(line);
            probe(buf, words, n >= 1 && n <= 1000 ? n : reps, rates);
        }
    }
    free(buf);
    return 0;
}
