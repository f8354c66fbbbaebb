/* ferry's C face, driven from C by two processes (a fork, then an
 * endpoint in each): WRITE and READ byte-exact at odd offsets and sizes, a
 * transfer with a notification, standalone notifications, and errors
 * that must be statuses with a reason, never crashes. Exit 0: all held;
 * otherwise the line that failed is printed. Run by capi/tests/c_program.rs. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "check.h"

#define LEN (1 << 20)

static unsigned char pattern(size_t i, unsigned seed) { return (unsigned char)(i * 31 + seed); }


/* The target: accepts, advertises two windows (one to write into, one to
 * read from), checks what lands, answers notifications. */
static int target(int to_client, int from_client) {
    ferry_endpoint *ep = NULL;
    ferry_config *cfg = ferry_config_new();
    CHECK(ferry_config_set(cfg, "FERRY_LISTEN_ADDR", "127.0.0.1") == FERRY_OK);
    CHECK(ferry_config_set(cfg, "FERRY_TRANSPORT", "tcp") == FERRY_OK);
    /* Typed regions below: their chunks go packed (the codec) both ways. */
    CHECK(ferry_config_set(cfg, "FERRY_COMPRESS", "on") == FERRY_OK);
    CHECK(ferry_endpoint_create(cfg, &ep) == FERRY_OK);
    ferry_config_free(cfg);
    CHECK(ferry_start_passive_accept(ep) == FERRY_OK);
    unsigned char meta[512];
    size_t meta_len = 0;
    CHECK(ferry_endpoint_metadata(ep, meta, 4, &meta_len) == FERRY_ERR_INVALID);
    CHECK(meta_len > 4 && meta_len <= sizeof meta);
    CHECK(ferry_endpoint_metadata(ep, meta, sizeof meta, &meta_len) == FERRY_OK);
    put_all(to_client, &meta_len, sizeof meta_len);
    put_all(to_client, meta, meta_len);

    uint64_t conn = 0;
    CHECK(ferry_accept(ep, 5000, &conn) == FERRY_OK);
    /* No second peer: a wait that runs out says so; a NULL output is
     * refused before any wait (a minute's wait would trip the harness). */
    uint64_t none = 0;
    CHECK(ferry_accept(ep, 50, &none) == FERRY_ERR_TIMEOUT);
    CHECK(strstr(ferry_last_error(), "50 ms") != NULL);
    time_t before = time(NULL);
    CHECK(ferry_accept(ep, 60000, NULL) == FERRY_ERR_INVALID);
    CHECK(time(NULL) - before < 30);
    CHECK(ferry_add_remote(ep, (const unsigned char *)"x", 1, NULL) == FERRY_ERR_INVALID);
    CHECK(ferry_connect(ep, "127.0.0.1", 1, NULL) == FERRY_ERR_INVALID);
    CHECK(ferry_peer_is_local(ep, conn, NULL) == FERRY_ERR_INVALID);
    unsigned char *into = calloc(LEN, 1), *from = malloc(LEN);
    for (size_t i = 0; i < LEN; i++) from[i] = pattern(i, 9);
    ferry_region *r_into = NULL, *r_from = NULL;
    CHECK(ferry_register(ep, into, LEN, 0, &r_into) == FERRY_OK);
    CHECK(ferry_register(ep, from, LEN, FERRY_ACCESS_READONLY, &r_from) == FERRY_OK);
    CHECK(ferry_region_set_dtype(r_into, FERRY_DTYPE_BF16) == FERRY_OK);
    CHECK(ferry_region_set_dtype(r_from, FERRY_DTYPE_BF16) == FERRY_OK);
    CHECK(ferry_region_set_dtype(r_from, 99) == FERRY_ERR_INVALID);
    unsigned char w_into[FERRY_WINDOW_LEN], w_from[FERRY_WINDOW_LEN];
    CHECK(ferry_advertise(ep, conn, r_into, 0, LEN, w_into, 10) == FERRY_ERR_INVALID);
    CHECK(ferry_advertise(ep, conn, r_into, 0, LEN, w_into, sizeof w_into) == FERRY_OK);
    CHECK(ferry_advertise(ep, FERRY_ANY_CONN, r_from, 0, LEN, w_from, sizeof w_from) == FERRY_OK);
    put_all(to_client, w_into, sizeof w_into);
    put_all(to_client, w_from, sizeof w_from);

    /* The WRITE's notification comes after its bytes are in place. */
    unsigned char note[FERRY_MAX_NOTIFY];
    size_t note_len = 0;
    uint64_t from_conn = 0;
    CHECK(ferry_recv_notification(ep, 10000, &from_conn, note, 2, &note_len) == FERRY_ERR_INVALID);
    CHECK(note_len == 7);
    CHECK(ferry_recv_notification(ep, 10000, &from_conn, note, sizeof note, &note_len) == FERRY_OK);
    CHECK(from_conn == conn && note_len == 7 && memcmp(note, "written", 7) == 0);
    /* Three pieces at odd offsets: [1, 1+4097) -> 3, [5000, +1) -> 7000,
     * [9999, +100000) -> 123457 of the window. */
    for (size_t i = 0; i < 4097; i++) CHECK(into[3 + i] == pattern(1 + i, 5));
    CHECK(into[7000] == pattern(5000, 5));
    for (size_t i = 0; i < 100000; i++) CHECK(into[123457 + i] == pattern(9999 + i, 5));
    CHECK(into[2] == 0 && into[3 + 4097] == 0);
    CHECK(ferry_send_notification(ep, conn, (const unsigned char *)"checked", 7) == FERRY_OK);

    /* Two-sided: two buffers posted, in order; the second too small for
     * its message (both sides fail, nothing lands). */
    memset(into, 0, LEN);
    ferry_message *m1 = NULL, *m2 = NULL;
    CHECK(ferry_recv(ep, conn, r_into, 0, 1000, &m1) == FERRY_OK);
    CHECK(ferry_recv(ep, conn, r_into, 1000, 10, &m2) == FERRY_OK);
    size_t got = 0;
    CHECK(ferry_message_wait(m1, 10000, &got) == FERRY_OK);
    CHECK(got == 500);
    for (size_t i = 0; i < 500; i++) CHECK(into[i] == pattern(i, 77));
    CHECK(ferry_message_wait(m2, 10000, &got) == FERRY_ERR_INVALID);
    CHECK(strstr(ferry_last_error(), "does not fit") != NULL);
    CHECK(into[1000] == 0);
    ferry_message_release(m1);
    ferry_message_release(m2);

    char done = 0;
    get_all(from_client, &done, 1);
    CHECK(ferry_deregister(r_into) == FERRY_OK);
    CHECK(ferry_deregister(r_from) == FERRY_OK);
    ferry_endpoint_destroy(ep);
    free(into);
    free(from);
    return 0;
}

static void errors(ferry_endpoint *ep, uint64_t conn, ferry_region *local, const unsigned char *w) {
    /* NULLs and short buffers are statuses with a reason. */
    CHECK(ferry_endpoint_metadata(NULL, NULL, 0, NULL) == FERRY_ERR_INVALID);
    CHECK(strstr(ferry_last_error(), "NULL") != NULL);
    ferry_transfer *t = NULL;
    ferry_desc d = {local, 0, 16, w, 10, 0};
    CHECK(ferry_post(ep, conn, FERRY_WRITE, &d, 1, NULL, 0, &t) == FERRY_ERR_INVALID);
    CHECK(strstr(ferry_last_error(), "descriptor 0") != NULL);
    ferry_desc past = {local, 0, 16, w, FERRY_WINDOW_LEN, LEN - 8};
    CHECK(ferry_post(ep, conn, FERRY_WRITE, &past, 1, NULL, 0, &t) == FERRY_ERR_INVALID);
    ferry_desc beyond = {local, LEN - 8, 16, w, FERRY_WINDOW_LEN, 0};
    CHECK(ferry_post(ep, conn, FERRY_WRITE, &beyond, 1, NULL, 0, &t) == FERRY_ERR_INVALID);
    CHECK(ferry_post(ep, conn, 7, &d, 1, NULL, 0, &t) == FERRY_ERR_INVALID);
    ferry_desc ok = {local, 0, 16, w, FERRY_WINDOW_LEN, 0};
    CHECK(ferry_post(ep, 987654, FERRY_WRITE, &ok, 1, NULL, 0, &t) == FERRY_ERR_DISCONNECTED);
    CHECK(ferry_post(ep, conn, FERRY_WRITE, NULL, 0, NULL, 0, &t) == FERRY_ERR_INVALID);
    /* A region registered read-only here is never a READ's destination. */
    static unsigned char ro_bytes[64];
    ferry_region *ro = NULL;
    CHECK(ferry_register(ep, ro_bytes, sizeof ro_bytes, FERRY_ACCESS_READONLY, &ro) == FERRY_OK);
    ferry_desc into_ro = {ro, 0, 16, w, FERRY_WINDOW_LEN, 0};
    CHECK(ferry_post(ep, conn, FERRY_READ, &into_ro, 1, NULL, 0, &t) == FERRY_ERR_INVALID);
    CHECK(strstr(ferry_last_error(), "read-only") != NULL);
    CHECK(ferry_deregister(ro) == FERRY_OK);
    /* A pointer that maps nothing is refused, naming it. */
    ferry_region *bad = NULL;
    CHECK(ferry_register(ep, (void *)0x1000, 4096, 0, &bad) == FERRY_ERR_INVALID);
    CHECK(strstr(ferry_last_error(), "0x1000") != NULL);
    CHECK(ferry_register(ep, (void *)local, 16, 99, &bad) == FERRY_ERR_INVALID);
    CHECK(ferry_config_set(NULL, "FERRY_SHARDS", "2") == FERRY_ERR_INVALID);
    ferry_config *cfg = ferry_config_new();
    CHECK(ferry_config_set(cfg, "FERRY_NO_SUCH_THING", "1") == FERRY_OK);
    ferry_endpoint *other = NULL;
    CHECK(ferry_endpoint_create(cfg, &other) == FERRY_ERR_INVALID);
    CHECK(strstr(ferry_last_error(), "FERRY_NO_SUCH_THING") != NULL);
    ferry_config_free(cfg);
    cfg = ferry_config_new();
    CHECK(ferry_config_set(cfg, "FERRY_SHARDS", "zero") == FERRY_OK);
    CHECK(ferry_endpoint_create(cfg, &other) == FERRY_ERR_INVALID);
    CHECK(strstr(ferry_last_error(), "FERRY_SHARDS") != NULL);
    ferry_config_free(cfg);
    cfg = ferry_config_new();
    CHECK(ferry_config_set(cfg, "FERRY_DRIVE", "pigeon") == FERRY_OK);
    CHECK(ferry_endpoint_create(cfg, &other) == FERRY_ERR_INVALID);
    CHECK(strstr(ferry_last_error(), "FERRY_DRIVE") != NULL);
    ferry_config_free(cfg);
    ferry_transfer_release(NULL);
    CHECK(ferry_deregister(NULL) == FERRY_OK);
}

static int client(int to_target, int from_target) {
    size_t meta_len = 0;
    unsigned char meta[512];
    get_all(from_target, &meta_len, sizeof meta_len);
    CHECK(meta_len <= sizeof meta);
    get_all(from_target, meta, meta_len);
    ferry_endpoint *ep = NULL;
    CHECK(ferry_endpoint_create(NULL, &ep) == FERRY_OK);
    uint64_t conn = 0;
    CHECK(ferry_add_remote(ep, meta, meta_len, &conn) == FERRY_OK);
    /* The target runs tcp only: a network peer, though on this host. */
    int is_local = -1;
    CHECK(ferry_peer_is_local(ep, conn, &is_local) == FERRY_OK && is_local == 0);
    CHECK(ferry_peer_is_local(ep, 987654, &is_local) == FERRY_ERR_DISCONNECTED);
    unsigned char w_into[FERRY_WINDOW_LEN], w_from[FERRY_WINDOW_LEN];
    get_all(from_target, w_into, sizeof w_into);
    get_all(from_target, w_from, sizeof w_from);

    unsigned char *buf = malloc(LEN);
    for (size_t i = 0; i < LEN; i++) buf[i] = pattern(i, 5);
    ferry_region *r = NULL;
    CHECK(ferry_register(ep, buf, LEN, 0, &r) == FERRY_OK);
    /* One post, three pieces, a notification after the data. */
    ferry_desc w[3] = {
        {r, 1, 4097, w_into, FERRY_WINDOW_LEN, 3},
        {r, 5000, 1, w_into, FERRY_WINDOW_LEN, 7000},
        {r, 9999, 100000, w_into, FERRY_WINDOW_LEN, 123457},
    };
    ferry_transfer *t = NULL;
    CHECK(ferry_post(ep, conn, FERRY_WRITE, w, 3, (const unsigned char *)"written", 7, &t) == FERRY_OK);
    /* Released unwatched: ferry still sends the note once the bytes are
     * in place (the target checks them when it arrives). */
    ferry_transfer_release(t);
    unsigned char note[16];
    size_t note_len = 0;
    uint64_t from_conn = 0;
    CHECK(ferry_recv_notification(ep, 10000, &from_conn, note, sizeof note, &note_len) == FERRY_OK);
    CHECK(note_len == 7 && memcmp(note, "checked", 7) == 0);

    /* READ the target's pattern back at odd places. */
    memset(buf, 0, LEN);
    ferry_desc rd[2] = {
        {r, 11, 65537, w_from, FERRY_WINDOW_LEN, 13},
        {r, 900001, 3, w_from, FERRY_WINDOW_LEN, LEN - 3},
    };
    CHECK(ferry_post(ep, conn, FERRY_READ, rd, 2, NULL, 0, &t) == FERRY_OK);
    int s;
    while ((s = ferry_transfer_poll(t)) == FERRY_PENDING) {
    }
    CHECK(s == FERRY_OK);
    CHECK(ferry_transfer_poll(t) == FERRY_OK);
    CHECK(ferry_transfer_wait(t, 10) == FERRY_OK);
    ferry_transfer_release(t);
    for (size_t i = 0; i < 65537; i++) CHECK(buf[11 + i] == pattern(13 + i, 9));
    for (size_t i = 0; i < 3; i++) CHECK(buf[900001 + i] == pattern(LEN - 3 + i, 9));
    /* The target registered it read-only: a WRITE into it is refused there. */
    ferry_desc wr = {r, 0, 8, w_from, FERRY_WINDOW_LEN, 0};
    CHECK(ferry_post(ep, conn, FERRY_WRITE, &wr, 1, NULL, 0, &t) == FERRY_OK);
    CHECK(ferry_transfer_wait(t, 10000) == FERRY_ERR_REMOTE);
    ferry_transfer_release(t);
    /* Cancelled: its outcome says so from then on (the bytes on the wire
     * still land); one that already reported keeps its outcome. */
    CHECK(ferry_post(ep, conn, FERRY_READ, rd, 2, NULL, 0, &t) == FERRY_OK);
    CHECK(ferry_transfer_cancel(t) == FERRY_OK);
    CHECK(ferry_transfer_poll(t) == FERRY_ERR_CANCELLED);
    CHECK(ferry_transfer_wait(t, 10) == FERRY_ERR_CANCELLED);
    ferry_transfer_release(t);
    CHECK(ferry_post(ep, conn, FERRY_READ, rd, 2, NULL, 0, &t) == FERRY_OK);
    CHECK(ferry_transfer_wait(t, 10000) == FERRY_OK);
    CHECK(ferry_transfer_cancel(t) == FERRY_OK);
    CHECK(ferry_transfer_poll(t) == FERRY_OK);
    ferry_transfer_release(t);
    CHECK(ferry_transfer_cancel(NULL) == FERRY_ERR_INVALID);

    /* Two-sided: a message that fits, then one longer than its buffer. */
    for (size_t i = 0; i < 500; i++) buf[i] = pattern(i, 77);
    ferry_message *m = NULL;
    size_t sent = 0;
    CHECK(ferry_send(ep, conn, r, 0, 500, &m) == FERRY_OK);
    CHECK(ferry_message_wait(m, 10000, &sent) == FERRY_OK && sent == 500);
    ferry_message_release(m);
    CHECK(ferry_send(ep, conn, r, 0, 20, &m) == FERRY_OK);
    CHECK(ferry_message_wait(m, 10000, &sent) == FERRY_ERR_INVALID);
    ferry_message_release(m);
    CHECK(ferry_send(ep, conn, r, LEN - 4, 8, &m) == FERRY_ERR_INVALID);

    errors(ep, conn, r, w_into);
    char done = 1;
    put_all(to_target, &done, 1);
    CHECK(ferry_deregister(r) == FERRY_OK);
    ferry_endpoint_destroy(ep);
    free(buf);
    return 0;
}

int main(void) {
    int t2c[2], c2t[2];
    CHECK(pipe(t2c) == 0 && pipe(c2t) == 0);
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
        close(t2c[1]);
        close(c2t[0]);
        exit(client(c2t[1], t2c[0]));
    }
    close(t2c[0]);
    close(c2t[1]);
    int rc = target(t2c[1], c2t[0]);
    int status = 0;
    CHECK(waitpid(pid, &status, 0) == pid);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    if (rc == 0) printf("ferry C face: two processes, all checks held\n");
    return rc;
}
