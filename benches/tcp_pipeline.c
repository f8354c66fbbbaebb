/* The tcp ceiling without ferry (issue 29): N connections over loopback,
 * each a pair of threads, the initiator keeping DEPTH 4 KiB frames (a
 * 40-byte header and the payload) in flight and the target answering each
 * frame with a 40-byte ack, every thread busy-polling non-blocking
 * sockets. Each initiator pass sends every frame its window allows in one
 * writev and reads what acks are there; each target pass reads what is
 * there and acks the whole frames in one writev. Prints ops/s and GB/s
 * over SECS. One connection of 32 against four of 8 is the ratio that
 * ferry's `--shards 4 --conns 4` is held to, with nothing spent on
 * anything but the sockets.
 *
 *   gcc -O2 -static -o /tmp/tcp_pipeline benches/tcp_pipeline.c -lpthread
 *   /tmp/tcp_pipeline CONNS DEPTH [SECS]
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "loopback_pair.h"

enum { HDR = 40, PAYLOAD = 4096, FRAME = HDR + PAYLOAD, MAX_DEPTH = 64, RBUF = 1 << 18 };

static atomic_int stop;
static int depth;

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* Reads what is there; returns bytes read (0 when dry). */
static size_t read_some(int fd, char *buf, size_t room) {
    ssize_t n = read(fd, buf, room);
    if (n > 0) return (size_t)n;
    if (n == 0 || errno != EAGAIN) die("read");
    return 0;
}

/* Writes all of iov (spinning on a full socket). */
static void write_all(int fd, struct iovec *iov, int cnt) {
    while (cnt > 0) {
        ssize_t n = writev(fd, iov, cnt);
        if (n < 0) {
            if (errno != EAGAIN) die("writev");
            if (atomic_load(&stop)) return;
            continue;
        }
        while (cnt > 0 && (size_t)n >= iov->iov_len) {
            n -= iov->iov_len;
            iov++;
            cnt--;
        }
        if (cnt > 0) {
            iov->iov_base = (char *)iov->iov_base + n;
            iov->iov_len -= n;
        }
    }
}

struct conn {
    int a, b;
    _Atomic long ops; /* acks received */
    pthread_t ti, tt;
};

static void *initiator(void *arg) {
    struct conn *c = arg;
    static __thread char hdr[MAX_DEPTH][HDR], payload[PAYLOAD], acks[RBUF];
    struct iovec iov[2 * MAX_DEPTH];
    int outstanding = 0;
    size_t ack_bytes = 0;
    while (!atomic_load(&stop)) {
        int k = 0;
        for (; outstanding < depth; outstanding++, k++) {
            iov[2 * k] = (struct iovec){hdr[k], HDR};
            iov[2 * k + 1] = (struct iovec){payload, PAYLOAD};
        }
        if (k) write_all(c->a, iov, 2 * k);
        ack_bytes += read_some(c->a, acks, sizeof acks);
        outstanding -= ack_bytes / HDR;
        atomic_fetch_add_explicit(&c->ops, (long)(ack_bytes / HDR), memory_order_relaxed);
        ack_bytes %= HDR;
    }
    return 0;
}

static void *target(void *arg) {
    struct conn *c = arg;
    static __thread char buf[RBUF], acks[RBUF / FRAME + 1][HDR];
    struct iovec iov[RBUF / FRAME + 1];
    size_t have = 0;
    while (!atomic_load(&stop)) {
        have += read_some(c->b, buf + have, sizeof buf - have);
        int frames = have / FRAME;
        if (!frames) continue;
        for (int i = 0; i < frames; i++) iov[i] = (struct iovec){acks[i], HDR};
        write_all(c->b, iov, frames);
        memmove(buf, buf + frames * FRAME, have % FRAME);
        have %= FRAME;
    }
    return 0;
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s CONNS DEPTH [SECS]\n", argv[0]);
        return 2;
    }
    int conns = atoi(argv[1]);
    depth = atoi(argv[2]);
    double secs = argc > 3 ? atof(argv[3]) : 2;
    if (conns < 1 || conns > 64 || depth < 1 || depth > MAX_DEPTH) {
        fprintf(stderr, "CONNS 1..64, DEPTH 1..%d\n", MAX_DEPTH);
        return 2;
    }
    struct conn *c = calloc(conns, sizeof *c);
    for (int i = 0; i < conns; i++) {
        tcp_pair(&c[i].a, &c[i].b);
        pthread_create(&c[i].tt, 0, target, &c[i]);
        pthread_create(&c[i].ti, 0, initiator, &c[i]);
    }
    usleep(300000); /* warm-up */
    long before = 0, after = 0;
    for (int i = 0; i < conns; i++) before += atomic_load_explicit(&c[i].ops, memory_order_relaxed);
    double t0 = now_s();
    usleep((useconds_t)(secs * 1e6));
    for (int i = 0; i < conns; i++) after += atomic_load_explicit(&c[i].ops, memory_order_relaxed);
    double dt = now_s() - t0;
    atomic_store(&stop, 1);
    for (int i = 0; i < conns; i++) {
        pthread_join(c[i].ti, 0);
        pthread_join(c[i].tt, 0);
    }
    double ops = (after - before) / dt;
    printf("{\"conns\":%d,\"depth\":%d,\"ops_per_s\":%.0f,\"gbps\":%.4f}\n", conns, depth, ops, ops * PAYLOAD / 1e9);
    return 0;
}
