/* What a C handle costs: ferry_transfer_poll on a transfer that has
 * ended (a lookup and a status, nothing else), and an 8-byte WRITE
 * posted, waited on and released (a handle given out and taken back per
 * op), between two endpoints of this process. Prints one JSON line.
 * Build against include/ and a libferry.so; benches/c_handles.sh runs two
 * builds' libraries alternately. */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "ferry.h"

#define CHECK(c)                                                              \
    do {                                                                      \
        if (!(c)) {                                                           \
            fprintf(stderr, "%s:%d: %s (%s)\n", __FILE__, __LINE__, #c,       \
                    ferry_last_error());                                      \
            exit(1);                                                          \
        }                                                                     \
    } while (0)

static double now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec;
}

int main(int argc, char **argv) {
    long polls = argc > 1 ? atol(argv[1]) : 5000000;
    long ops = argc > 2 ? atol(argv[2]) : 20000;
    ferry_endpoint *a = NULL, *b = NULL;
    CHECK(ferry_endpoint_create(NULL, &a) == FERRY_OK);
    CHECK(ferry_endpoint_create(NULL, &b) == FERRY_OK);
    CHECK(ferry_start_passive_accept(b) == FERRY_OK);
    unsigned char meta[512];
    size_t meta_len = 0;
    CHECK(ferry_endpoint_metadata(b, meta, sizeof meta, &meta_len) == FERRY_OK);
    uint64_t conn = 0, bconn = 0;
    CHECK(ferry_add_remote(a, meta, meta_len, &conn) == FERRY_OK);
    CHECK(ferry_accept(b, 5000, &bconn) == FERRY_OK);
    static unsigned char src[4096], dst[4096];
    ferry_region *rs = NULL, *rd = NULL;
    CHECK(ferry_register(a, src, sizeof src, 0, &rs) == FERRY_OK);
    CHECK(ferry_register(b, dst, sizeof dst, 0, &rd) == FERRY_OK);
    unsigned char w[FERRY_WINDOW_LEN];
    CHECK(ferry_advertise(b, bconn, rd, 0, sizeof dst, w, sizeof w) == FERRY_OK);
    ferry_desc d = {rs, 0, 8, w, FERRY_WINDOW_LEN, 0};

    ferry_transfer *t = NULL;
    CHECK(ferry_post(a, conn, FERRY_WRITE, &d, 1, NULL, 0, &t) == FERRY_OK);
    CHECK(ferry_transfer_wait(t, 5000) == FERRY_OK);
    double t0 = now_ns();
    for (long i = 0; i < polls; i++) CHECK(ferry_transfer_poll(t) == FERRY_OK);
    double poll_ns = (now_ns() - t0) / (double)polls;
    ferry_transfer_release(t);

    t0 = now_ns();
    for (long i = 0; i < ops; i++) {
        CHECK(ferry_post(a, conn, FERRY_WRITE, &d, 1, NULL, 0, &t) == FERRY_OK);
        int s;
        while ((s = ferry_transfer_poll(t)) == FERRY_PENDING) {
        }
        CHECK(s == FERRY_OK);
        ferry_transfer_release(t);
    }
    double op_us = (now_ns() - t0) / (double)ops / 1e3;
    printf("{\"poll_ns\": %.2f, \"write_8b_us\": %.3f}\n", poll_ns, op_us);
    ferry_deregister(rs);
    ferry_deregister(rd);
    ferry_endpoint_destroy(a);
    ferry_endpoint_destroy(b);
    return 0;
}
