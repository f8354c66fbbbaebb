/* What loopback TCP costs a sender on this machine (issue 29): a null
 * syscall, a dry readv, a writev of N bytes read back by the same thread,
 * and the writev alone while another thread reads the socket (spinning on
 * readv, spinning on epoll_wait(0), or blocked in epoll_wait). On loopback
 * the sender's writev also runs the receiver's TCP input, so a send's cost
 * is mostly fixed: what a shard saves by sending several frames at once.
 *
 *   gcc -O2 -static -o /tmp/loopback_cost benches/loopback_cost.c -lpthread
 *   /tmp/loopback_cost
 *
 * Measured 2026-12-04 (BENCHMARKS.md, "tcp over four shards against four
 * independent pipelines"): nvidia-h200 (16 cores, KVM) null syscall 94 ns,
 * dry readv 197 ns, writev + read back 1.7-1.9 us for 40 B-12 KiB, writev
 * with the reader on another core 3.1-5.3 us whatever the reader polls
 * with; the 2-core machine (two runs) 170-210 ns, 460-510 ns, 3.6-4.7 us,
 * 4.5-8.5 us. */
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
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "loopback_pair.h"

static double now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e9 + t.tv_nsec;
}

static char rbuf[1 << 18], src[16 * 4136];
static int reader_fd, reader_mode; /* 0 spin readv, 1 spin epoll_wait(0), 2 block */
static atomic_int stop;
static const char *modes[] = {"spins on readv", "spins on epoll_wait(0)", "blocks in epoll_wait"};

static void *reader(void *unused) {
    (void)unused;
    int ep = epoll_create1(0), readable = 1;
    struct epoll_event e = {.events = EPOLLIN | EPOLLET, .data.fd = reader_fd};
    epoll_ctl(ep, EPOLL_CTL_ADD, reader_fd, &e);
    while (!atomic_load(&stop)) {
        struct iovec v = {rbuf, sizeof rbuf};
        if (reader_mode > 0 && !readable) {
            struct epoll_event o;
            if (epoll_wait(ep, &o, 1, reader_mode == 1 ? 0 : 100) <= 0) continue;
        }
        readable = readv(reader_fd, &v, 1) > 0;
    }
    close(ep);
    return 0;
}

int main(void) {
    const int calls = 2000000, sizes[] = {40, 4136, 3 * 4136, 8 * 4136, 16 * 4136};
    int a, b;
    double t = now_ns();
    for (int i = 0; i < calls; i++) syscall(SYS_getppid);
    printf("null syscall %.0f ns\n", (now_ns() - t) / calls);
    tcp_pair(&a, &b);
    char small[64];
    struct iovec v = {small, sizeof small};
    t = now_ns();
    for (int i = 0; i < calls / 4; i++) readv(b, &v, 1);
    printf("dry readv %.0f ns\n", (now_ns() - t) / (calls / 4));
    for (int k = 0; k < 5; k++) {
        const int sz = sizes[k], m = 20000;
        double tw = 0, tr = 0;
        for (int i = 0; i < m; i++) {
            struct iovec w = {src, sz};
            double t0 = now_ns();
            if (writev(a, &w, 1) != sz) die("writev");
            double t1 = now_ns();
            for (int got = 0; got < sz;) {
                struct iovec r = {rbuf, sizeof rbuf};
                ssize_t n = readv(b, &r, 1);
                if (n > 0) got += n;
                else if (n < 0 && errno != EAGAIN) die("readv");
            }
            tw += t1 - t0;
            tr += now_ns() - t1;
        }
        printf("one thread: writev %6d B %5.0f ns, reading it back %5.0f ns\n", sz, tw / m, tr / m);
    }
    for (reader_mode = 0; reader_mode < 3; reader_mode++) {
        for (int k = 0; k < 3; k++) {
            const int sz = sizes[k], m = 50000;
            pthread_t th;
            reader_fd = b;
            atomic_store(&stop, 0);
            pthread_create(&th, 0, reader, 0);
            usleep(10000);
            double tw = 0;
            for (int i = 0; i < m; i++) {
                struct iovec w = {src, sz};
                double t0 = now_ns();
                ssize_t n = writev(a, &w, 1);
                tw += now_ns() - t0;
                if (n < 0) usleep(1); /* the reader fell behind: let it drain */
            }
            atomic_store(&stop, 1);
            pthread_join(th, 0);
            while (read(b, rbuf, sizeof rbuf) > 0) {
            }
            printf("reader on another thread %-22s: writev %6d B %5.0f ns\n", modes[reader_mode], sz, tw / m);
        }
    }
    return 0;
}
