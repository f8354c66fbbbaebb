/* A C host keeps SIGPIPE's default disposition (the process dies) and
 * lives through its peers' deaths. Each round a child process is the
 * target: it accepts, advertises a window and is killed (SIGKILL) once a
 * first WRITE landed; the parent then keeps writing, notifying and sending
 * to the dead peer. Every call must return a status; none may raise a
 * signal. The transport and drive mode come from the environment
 * (FERRY_TRANSPORT, FERRY_DRIVE), set by capi/tests/c_program.rs. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "check.h"

#define LEN (1 << 20)
#define ROUNDS 4

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* The target: publishes its metadata and a window, then waits to die. */
static int child(int to_parent) {
    /* Its own threads serve requests while it waits to be killed,
     * whatever drive mode the parent is tested in. */
    ferry_config *cfg = ferry_config_new();
    CHECK(ferry_config_set(cfg, "FERRY_DRIVE", "threads") == FERRY_OK);
    ferry_endpoint *ep = NULL;
    CHECK(ferry_endpoint_create(cfg, &ep) == FERRY_OK);
    ferry_config_free(cfg);
    CHECK(ferry_start_passive_accept(ep) == FERRY_OK);
    unsigned char meta[512];
    size_t meta_len = 0;
    CHECK(ferry_endpoint_metadata(ep, meta, sizeof meta, &meta_len) == FERRY_OK);
    put_all(to_parent, &meta_len, sizeof meta_len);
    put_all(to_parent, meta, meta_len);
    uint64_t conn = 0;
    CHECK(ferry_accept(ep, 20000, &conn) == FERRY_OK);
    unsigned char *into = calloc(LEN, 1);
    ferry_region *r = NULL;
    CHECK(ferry_register(ep, into, LEN, 0, &r) == FERRY_OK);
    unsigned char w[FERRY_WINDOW_LEN];
    CHECK(ferry_advertise(ep, conn, r, 0, LEN, w, sizeof w) == FERRY_OK);
    put_all(to_parent, w, sizeof w);
    /* Posted receives, so the parent's first sends have a place to land. */
    ferry_message *m = NULL;
    for (int i = 0; i < 4; i++) CHECK(ferry_recv(ep, conn, r, 0, LEN, &m) == FERRY_OK);
    for (;;) pause();
}

/* An outcome a call may give for a dead peer: anything but a crash, a
 * panic or an invalid-argument complaint (the arguments are good). */
static int acceptable(int s) {
    return s == FERRY_OK || s == FERRY_PENDING || s == FERRY_ERR_DISCONNECTED ||
           s == FERRY_ERR_TIMEOUT || s == FERRY_ERR_BUSY;
}

static void round_against(ferry_endpoint *ep, pid_t pid, int from_child, ferry_region *r) {
    size_t meta_len = 0;
    unsigned char meta[512];
    get_all(from_child, &meta_len, sizeof meta_len);
    CHECK(meta_len <= sizeof meta);
    get_all(from_child, meta, meta_len);
    uint64_t conn = 0;
    CHECK(ferry_add_remote(ep, meta, meta_len, &conn) == FERRY_OK);
    unsigned char w[FERRY_WINDOW_LEN];
    get_all(from_child, w, sizeof w);

    ferry_desc d = {r, 0, LEN, w, FERRY_WINDOW_LEN, 0};
    ferry_transfer *t = NULL;
    CHECK(ferry_post(ep, conn, FERRY_WRITE, &d, 1, NULL, 0, &t) == FERRY_OK);
    CHECK(ferry_transfer_wait(t, 10000) == FERRY_OK);
    ferry_transfer_release(t);

    CHECK(kill(pid, SIGKILL) == 0);
    int status = 0;
    CHECK(waitpid(pid, &status, 0) == pid);

    /* Keep every kind of send going at the corpse for a while: with
     * SIGPIPE at its default, one unguarded send would end this process. */
    int failed = 0, calls = 0;
    double until = now_s() + 3.0;
    while (now_s() < until) {
        int s = ferry_post(ep, conn, FERRY_WRITE, &d, 1, (const unsigned char *)"n", 1, &t);
        CHECK(acceptable(s));
        if (s == FERRY_OK) {
            s = ferry_transfer_wait(t, 200);
            CHECK(acceptable(s));
            ferry_transfer_release(t);
        }
        failed += s == FERRY_ERR_DISCONNECTED;
        s = ferry_send_notification(ep, conn, (const unsigned char *)"hello", 5);
        CHECK(acceptable(s));
        failed += s == FERRY_ERR_DISCONNECTED;
        ferry_message *m = NULL;
        s = ferry_send(ep, conn, r, 0, 4096, &m);
        CHECK(acceptable(s));
        if (s == FERRY_OK) {
            s = ferry_message_wait(m, 50, NULL);
            CHECK(acceptable(s));
            ferry_message_release(m);
        }
        failed += s == FERRY_ERR_DISCONNECTED;
        calls += 3;
    }
    printf("round: %d calls at a dead peer, %d said disconnected\n", calls, failed);
    (void)ferry_remove_remote(ep, conn); /* OK, or already gone */
}

int main(void) {
    struct sigaction sa;
    CHECK(sigaction(SIGPIPE, NULL, &sa) == 0);
    CHECK(sa.sa_handler == SIG_DFL); /* the point of the test */
    pid_t pids[ROUNDS];
    int from[ROUNDS];
    /* Every child starts before the parent's endpoint exists: no fork of
     * a process with threads. */
    for (int i = 0; i < ROUNDS; i++) {
        int p[2];
        CHECK(pipe(p) == 0);
        pids[i] = fork();
        CHECK(pids[i] >= 0);
        if (pids[i] == 0) {
            close(p[0]);
            exit(child(p[1]));
        }
        close(p[1]);
        from[i] = p[0];
    }
    ferry_endpoint *ep = NULL;
    CHECK(ferry_endpoint_create(NULL, &ep) == FERRY_OK);
    unsigned char *buf = malloc(LEN);
    memset(buf, 7, LEN);
    ferry_region *r = NULL;
    CHECK(ferry_register(ep, buf, LEN, 0, &r) == FERRY_OK);
    for (int i = 0; i < ROUNDS; i++) round_against(ep, pids[i], from[i], r);
    CHECK(ferry_deregister(r) == FERRY_OK);
    ferry_endpoint_destroy(ep);
    free(buf);
    printf("ferry C face: SIGPIPE at its default, %d peers died, the host lived\n", ROUNDS);
    return 0;
}
