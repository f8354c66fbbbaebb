/* Completion without polling, from C: another thread posts 1 000
 * transfers over 4 connections in waves, and this thread waits for them
 * in poll(2) on the endpoint's completion fd (ferry_endpoint_fd /
 * ferry_endpoint_ack). Every transfer is seen done exactly once; the CPU
 * this thread used is printed (measured, not asserted). */
#define _GNU_SOURCE /* RUSAGE_THREAD */
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <unistd.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>

#include "check.h"

#define CONNS 4
#define TRANSFERS 1000
#define WAVE 40
#define BLOCK 4096

static double thread_cpu_ms(void) {
    struct rusage ru;
    CHECK(getrusage(RUSAGE_THREAD, &ru) == 0);
    return (ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) * 1e3 +
           (ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) / 1e3;
}

static double now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

static ferry_endpoint *ep;
static ferry_region *r;
static uint64_t conn[CONNS];
static unsigned char w[FERRY_WINDOW_LEN];
static ferry_transfer *t[TRANSFERS];
static atomic_int posted;

/* A wave of WAVE transfers every 10 ms, as a service's requests come. */
static void *post(void *arg) {
    (void)arg;
    for (int i = 0; i < TRANSFERS;) {
        for (int k = 0; k < WAVE && i < TRANSFERS; k++, i++) {
            ferry_desc d = {r, (size_t)i * BLOCK, BLOCK, w, FERRY_WINDOW_LEN, (uint64_t)i * BLOCK};
            CHECK(ferry_post(ep, conn[i % CONNS], FERRY_WRITE, &d, 1, NULL, 0, &t[i]) == FERRY_OK);
            atomic_store_explicit(&posted, i + 1, memory_order_release);
        }
        usleep(10000);
    }
    return NULL;
}

int main(void) {
    ferry_config *cfg = ferry_config_new();
    CHECK(ferry_config_set(cfg, "FERRY_LISTEN_ADDR", "127.0.0.1") == FERRY_OK);
    ferry_endpoint *peer = NULL;
    CHECK(ferry_endpoint_create(cfg, &ep) == FERRY_OK);
    CHECK(ferry_endpoint_create(cfg, &peer) == FERRY_OK);
    ferry_config_free(cfg);
    CHECK(ferry_start_passive_accept(peer) == FERRY_OK);
    unsigned char meta[512];
    size_t meta_len = 0;
    CHECK(ferry_endpoint_metadata(peer, meta, sizeof meta, &meta_len) == FERRY_OK);
    for (int c = 0; c < CONNS; c++) CHECK(ferry_add_remote(ep, meta, meta_len, &conn[c]) == FERRY_OK);

    static unsigned char near[TRANSFERS * BLOCK], far[TRANSFERS * BLOCK];
    ferry_region *fr = NULL;
    CHECK(ferry_register(ep, near, sizeof near, 0, &r) == FERRY_OK);
    CHECK(ferry_register(peer, far, sizeof far, 0, &fr) == FERRY_OK);
    CHECK(ferry_advertise(peer, FERRY_ANY_CONN, fr, 0, sizeof far, w, sizeof w) == FERRY_OK);
    for (int i = 0; i < TRANSFERS; i++) memset(near + (size_t)i * BLOCK, i & 0xff, BLOCK);

    int fd = -1, again = -1;
    CHECK(ferry_endpoint_fd(ep, &fd) == FERRY_OK && fd >= 0);
    CHECK(ferry_endpoint_fd(ep, &again) == FERRY_OK && again == fd);

    static int seen[TRANSFERS];
    int done = 0, wakes = 0, lo = 0; /* below lo: all seen */
    pthread_t poster;
    double cpu0 = thread_cpu_ms(), t0 = now_ms();
    CHECK(pthread_create(&poster, NULL, post, NULL) == 0);
    while (done < TRANSFERS) {
        CHECK(ferry_endpoint_ack(ep) == FERRY_OK);
        int n_posted = atomic_load_explicit(&posted, memory_order_acquire);
        int in_flight = 0;
        while (lo < n_posted && t[lo] == NULL) lo++;
        for (int i = lo; i < n_posted; i++) {
            if (t[i] == NULL) continue;
            int s = ferry_transfer_poll(t[i]);
            if (s == FERRY_PENDING) {
                in_flight++;
                continue;
            }
            CHECK(s == FERRY_OK);
            ferry_transfer_release(t[i]);
            t[i] = NULL;
            seen[i]++;
            done++;
        }
        if (done == TRANSFERS) break;
        /* Nothing in flight: the next wave is at most 10 ms away. */
        struct pollfd p = {fd, POLLIN, 0};
        int n = poll(&p, 1, in_flight ? 10000 : 10);
        CHECK(n >= 0);
        if (in_flight) CHECK(n == 1); /* else a completion was missed */
        wakes += n;
    }
    CHECK(pthread_join(poster, NULL) == 0);
    double cpu = thread_cpu_ms() - cpu0, wall = now_ms() - t0;
    for (int i = 0; i < TRANSFERS; i++) CHECK(seen[i] == 1);
    for (int i = 0; i < TRANSFERS; i++) CHECK(far[(size_t)i * BLOCK + BLOCK - 1] == (i & 0xff));
    printf("%d transfers over %d connections, %d wakes; the waiting thread used %.2f ms of CPU in "
           "%.0f ms (%.2f %% of a core)\n",
           TRANSFERS, CONNS, wakes, cpu, wall, 100.0 * cpu / wall);
    /* The metrics count every transfer, once. */
    size_t need = 0;
    CHECK(ferry_metrics(ep, NULL, 0, &need) == FERRY_ERR_INVALID && need > 0);
    static char text[1 << 16];
    size_t text_len = 0;
    CHECK(ferry_metrics(ep, text, sizeof text - 1, &text_len) == FERRY_OK && text_len < sizeof text);
    text[text_len] = 0;
    char want[128], or[128]; /* same host: shm, unless it is off here */
    snprintf(want, sizeof want, "ferry_ops_total{op=\"write\",transport=\"shm\",result=\"ok\"} %d\n",
             TRANSFERS);
    snprintf(or, sizeof or, "ferry_ops_total{op=\"write\",transport=\"tcp\",result=\"ok\"} %d\n",
             TRANSFERS);
    CHECK(strstr(text, want) != NULL || strstr(text, or) != NULL);
    snprintf(want, sizeof want, "ferry_op_duration_seconds_count{op=\"write\"} %d\n", TRANSFERS);
    CHECK(strstr(text, want) != NULL);
    CHECK(ferry_deregister(r) == FERRY_OK);
    CHECK(ferry_deregister(fr) == FERRY_OK);
    ferry_endpoint_destroy(ep);
    ferry_endpoint_destroy(peer);
    printf("every completion seen once through the fd\n");
    return 0;
}
