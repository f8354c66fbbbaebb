/* A careless C caller: every handle type released twice, used after its
 * release, and made up. Each is FERRY_ERR_INVALID (or, for the void
 * releases, nothing but a last error), never undefined behaviour: built
 * with AddressSanitizer by capi/tests/c_program.rs, a read of freed
 * memory would end this process. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

#define DEAD(call)                                                 \
    do {                                                           \
        CHECK((call) == FERRY_ERR_INVALID);                        \
        CHECK(strstr(ferry_last_error(), "not a live handle") != NULL); \
    } while (0)

int main(void) {
    /* Config: used and freed after its free. */
    ferry_config *cfg = ferry_config_new();
    CHECK(cfg != NULL);
    CHECK(ferry_config_set(cfg, "FERRY_LISTEN_ADDR", "127.0.0.1") == FERRY_OK);
    CHECK(ferry_config_set(cfg, "FERRY_TRANSPORT", "tcp") == FERRY_OK);
    ferry_endpoint *ep = NULL;
    CHECK(ferry_endpoint_create(cfg, &ep) == FERRY_OK);
    ferry_config_free(cfg);
    DEAD(ferry_config_set(cfg, "FERRY_SHARDS", "2"));
    ferry_config_free(cfg); /* twice: nothing */
    CHECK(strstr(ferry_last_error(), "not a live handle") != NULL);
    ferry_endpoint *other = NULL;
    DEAD(ferry_endpoint_create(cfg, &other));

    /* A second endpoint to talk to. */
    ferry_endpoint *peer = NULL;
    CHECK(ferry_endpoint_create(NULL, &peer) == FERRY_OK);
    CHECK(ferry_start_passive_accept(peer) == FERRY_OK);
    unsigned char meta[512];
    size_t meta_len = 0;
    CHECK(ferry_endpoint_metadata(peer, meta, sizeof meta, &meta_len) == FERRY_OK);
    uint64_t conn = 0, pconn = 0;
    CHECK(ferry_add_remote(ep, meta, meta_len, &conn) == FERRY_OK);
    CHECK(ferry_accept(peer, 5000, &pconn) == FERRY_OK);

    /* Region: deregistered twice, then used. */
    static unsigned char buf[4096], far[4096];
    ferry_region *r = NULL, *fr = NULL;
    CHECK(ferry_register(ep, buf, sizeof buf, 0, &r) == FERRY_OK);
    CHECK(ferry_register(peer, far, sizeof far, 0, &fr) == FERRY_OK);
    unsigned char w[FERRY_WINDOW_LEN];
    CHECK(ferry_advertise(peer, pconn, fr, 0, sizeof far, w, sizeof w) == FERRY_OK);
    ferry_region *gone = NULL;
    CHECK(ferry_register(ep, buf, 64, 0, &gone) == FERRY_OK);
    CHECK(ferry_deregister(gone) == FERRY_OK);
    DEAD(ferry_deregister(gone));
    DEAD(ferry_region_set_dtype(gone, FERRY_DTYPE_BF16));
    DEAD(ferry_advertise(ep, conn, gone, 0, 64, w, sizeof w));
    ferry_desc bad = {gone, 0, 16, w, FERRY_WINDOW_LEN, 0};
    ferry_transfer *t = NULL;
    CHECK(ferry_post(ep, conn, FERRY_WRITE, &bad, 1, NULL, 0, &t) == FERRY_ERR_INVALID);
    ferry_message *m = NULL;
    DEAD(ferry_send(ep, conn, gone, 0, 16, &m));

    /* Transfer: released twice, then polled, waited on, cancelled. */
    ferry_desc d = {r, 0, 64, w, FERRY_WINDOW_LEN, 0};
    CHECK(ferry_post(ep, conn, FERRY_WRITE, &d, 1, NULL, 0, &t) == FERRY_OK);
    CHECK(ferry_transfer_wait(t, 5000) == FERRY_OK);
    ferry_transfer_release(t);
    ferry_transfer_release(t);
    CHECK(strstr(ferry_last_error(), "not a live handle") != NULL);
    DEAD(ferry_transfer_poll(t));
    DEAD(ferry_transfer_wait(t, 10));
    DEAD(ferry_transfer_cancel(t));

    /* Prepared transfer: posted three times (each moves what the memory
     * holds then), freed twice, then posted. */
    ferry_prepared *p = NULL;
    CHECK(ferry_prepare(ep, conn, FERRY_WRITE, &bad, 1, &p) == FERRY_ERR_INVALID);
    CHECK(ferry_prepare(ep, conn, 7, &d, 1, &p) == FERRY_ERR_INVALID);
    CHECK(ferry_prepare(ep, conn, FERRY_WRITE, &d, 1, &p) == FERRY_OK);
    for (int round = 0; round < 3; round++) {
        memset(buf, 'a' + round, 64);
        CHECK(ferry_post_prepared(p, NULL, 0, &t) == FERRY_OK);
        CHECK(ferry_transfer_wait(t, 5000) == FERRY_OK);
        ferry_transfer_release(t);
        CHECK(far[0] == 'a' + round && far[63] == 'a' + round);
    }
    ferry_prepared_free(p);
    ferry_prepared_free(p);
    CHECK(strstr(ferry_last_error(), "not a live handle") != NULL);
    DEAD(ferry_post_prepared(p, NULL, 0, &t));

    /* Message: released twice, then polled and waited on. */
    ferry_message *rm = NULL;
    CHECK(ferry_recv(peer, pconn, fr, 0, 64, &rm) == FERRY_OK);
    CHECK(ferry_send(ep, conn, r, 0, 8, &m) == FERRY_OK);
    size_t n = 0;
    CHECK(ferry_message_wait(m, 5000, &n) == FERRY_OK && n == 8);
    CHECK(ferry_message_wait(rm, 5000, &n) == FERRY_OK && n == 8);
    ferry_message_release(m);
    ferry_message_release(m);
    CHECK(strstr(ferry_last_error(), "not a live handle") != NULL);
    DEAD(ferry_message_poll(m, &n));
    DEAD(ferry_message_wait(m, 10, &n));
    ferry_message_release(rm);

    /* Made-up handles of every kind. */
    DEAD(ferry_transfer_poll((ferry_transfer *)(uintptr_t)0xdeadbeef));
    DEAD(ferry_message_poll((ferry_message *)(uintptr_t)0x12345, &n));
    DEAD(ferry_region_set_dtype((ferry_region *)(uintptr_t)7, 0));
    DEAD(ferry_start_passive_accept((ferry_endpoint *)(uintptr_t)0x1000));
    DEAD(ferry_deregister((ferry_region *)(uintptr_t)0x5555));

    /* Endpoint: destroyed twice, then used. */
    CHECK(ferry_deregister(r) == FERRY_OK);
    CHECK(ferry_deregister(fr) == FERRY_OK);
    ferry_endpoint_destroy(ep);
    ferry_endpoint_destroy(ep);
    CHECK(strstr(ferry_last_error(), "not a live handle") != NULL);
    DEAD(ferry_start_passive_accept(ep));
    DEAD(ferry_add_remote(ep, meta, meta_len, &conn));
    DEAD(ferry_send_notification(ep, conn, (const unsigned char *)"x", 1));
    ferry_endpoint_destroy(peer);
    printf("ferry C face: every misuse refused, nothing freed read\n");
    return 0;
}
