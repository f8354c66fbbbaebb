// The NIXL backend "FERRY": NIXL's engine interface (nixl_abi.h) over
// ferry's C face (include/ferry.h). Thin on purpose: ferry moves the
// bytes, runs its own threads and sends a transfer's notification once its
// data is in place; this layer maps NIXL's names onto ferry's handles.
//
// What peers exchange (all of it hostile until checked):
//   - conn info (getConnInfo): the ferry endpoint's metadata;
//   - public data of a registration (getPublicData): "F" + its 64-byte key
//     window (ferry checks every access against it on the owner's side),
//     and for GPU memory its 136-byte CUDA IPC window after it (a
//     same-host peer then copies GPU to GPU itself: cuMemcpy through the
//     IPC mapping, ferry's fastest same-host GPU path);
//   - notifications, each one ferry notification whose first byte says what
//     it is: 'H' + agent name (the first one on every connection this
//     plugin opens: who is on it; what its notifications are reported as
//     from, never where our own traffic goes: that takes the connections
//     we open to the conn info NIXL loaded; a bad, second or taken name
//     drops the connection. A name whose conn info NIXL loaded is proven,
//     not believed: the endpoint at that conn info's address must vouch
//     that it dialed this very connection to us (ferry_vouch, answered by
//     its accept loop), else the connection is dropped; a name claimed
//     before its conn info came is proven when it comes. A name NIXL
//     knows nothing of yet has nothing to be checked against: first come,
//     until proven otherwise), 'N' + a whole message, 'L' + piece of a
//     long message (u64 id, u32 index, u32 count, bytes; reassembled, the
//     count bounded, at most MAX_PARTIAL_PER_CONN unfinished and
//     MAX_PARTIAL_BYTES_PER_CONN held per connection: the oldest go).

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <new>
#include <thread>
#include <unordered_set>

#include "ferry.h"
#include "nixl_abi.h"

namespace {

// The longest notification this backend carries (NIXL sets no bound;
// this one is ours so a peer cannot make us hold more).
constexpr size_t MAX_NOTIF_BYTES = 1 << 20;
// A message fits one ferry notification after its kind byte.
constexpr size_t WHOLE_MAX = FERRY_MAX_NOTIFY - 1;
// The header of a piece: kind, id, index, count.
constexpr size_t PIECE_HEADER = 1 + 8 + 4 + 4;
constexpr size_t PIECE_MAX = FERRY_MAX_NOTIFY - PIECE_HEADER;
constexpr size_t MAX_PIECES = (MAX_NOTIF_BYTES + PIECE_MAX - 1) / PIECE_MAX;
// Long messages being reassembled per connection, and their bytes; past
// either the oldest go (a peer that never finishes its messages holds at
// most this much of our memory per connection).
constexpr size_t MAX_PARTIAL_PER_CONN = 64;
constexpr size_t MAX_PARTIAL_BYTES_PER_CONN = 2 * MAX_NOTIF_BYTES + FERRY_MAX_NOTIFY;
// How long a piece after a long message's first waits for room in its
// connection's outbox (FERRY_NOTIFY_OUTBOX): a message goes whole, or is
// refused before its first piece, never cut.
constexpr std::chrono::milliseconds PIECE_ROOM_WAIT{10000};
// A peer's hello: its agent name at most this long, valid UTF-8 (NIXL's
// Python API decodes names), one per connection; names claimed by peers'
// connections at most MAX_CLAIMS at once.
constexpr size_t MAX_AGENT_NAME = 256;
constexpr size_t MAX_CLAIMS = 4096;
// Unproven names logged (a flood of names logs this many lines at most).
constexpr size_t MAX_UNPROVEN_SAID = 8;
// Notifications taken per getNotifs call (the rest wait for the next).
constexpr int MAX_NOTIFS_PER_CALL = 4096;

constexpr uint32_t LOCAL_MAGIC = 0x4c595246;  // "FRYL"
constexpr uint32_t REMOTE_MAGIC = 0x52595246; // "FRYR"
constexpr uint32_t REQ_MAGIC = 0x51595246;    // "FRYQ"

void log_failure(const char *what, int32_t rc) {
    std::fprintf(stderr, "ferry nixl: %s failed (%d): %s\n", what, rc, ferry_last_error());
}

nixl_status_t to_nixl(int32_t rc) {
    switch (rc) {
    case FERRY_OK:
        return NIXL_SUCCESS;
    case FERRY_PENDING:
        return NIXL_IN_PROG;
    case FERRY_ERR_INVALID:
        return NIXL_ERR_INVALID_PARAM;
    case FERRY_ERR_DISCONNECTED:
        return NIXL_ERR_REMOTE_DISCONNECT;
    // The connection failed; NIXL has no status of its own for these two,
    // so each takes the nearest one not already used for another cause:
    // the backend gave up waiting, the peer did what it may not.
    case FERRY_ERR_PEER_TIMEOUT:
        return NIXL_ERR_BACKEND;
    case FERRY_ERR_PEER_MISBEHAVED:
        return NIXL_ERR_NOT_ALLOWED;
    case FERRY_ERR_CANCELLED:
        return NIXL_ERR_CANCELED;
    default:
        return NIXL_ERR_BACKEND;
    }
}

struct LocalMD : nixlBackendMD {
    uint32_t magic = LOCAL_MAGIC;
    ferry_region *region = nullptr;
    uintptr_t base = 0;
    size_t len = 0;
    std::string public_data; // "F" + window [+ IPC window]
    LocalMD() : nixlBackendMD(true) {}
};

struct RemoteMD : nixlBackendMD {
    uint32_t magic = REMOTE_MAGIC;
    std::string agent;
    uintptr_t base = 0;
    size_t len = 0;
    std::string window; // FERRY_WINDOW_LEN bytes
    std::string ipc;    // FERRY_IPC_WINDOW_LEN bytes, or none
    RemoteMD() : nixlBackendMD(false) {}
};

struct ReqH : nixlBackendReqH {
    uint32_t magic = REQ_MAGIC;
    uint32_t op = FERRY_WRITE;
    std::string agent;
    std::vector<ferry_desc> descs;
    ferry_transfer *t = nullptr;
    // The descriptors checked once (ferry_prepare) for the connection
    // they were checked on, so a repost checks nothing per descriptor:
    // made by the first post of a CUDA IPC handle (planned: one kernel
    // launch, cheaper than a plain post even once), by the second of any
    // other (a handle posted once, as vLLM's, is not checked twice), and
    // again after a reconnect.
    ferry_prepared *prep = nullptr;
    uint64_t prep_conn = 0;
    bool ipc = false;
    uint64_t posts = 0;
};

const LocalMD *as_local(const nixlBackendMD *md) {
    auto *l = static_cast<const LocalMD *>(md);
    return (l != nullptr && l->magic == LOCAL_MAGIC) ? l : nullptr;
}

const RemoteMD *as_remote(const nixlBackendMD *md) {
    auto *r = static_cast<const RemoteMD *>(md);
    return (r != nullptr && r->magic == REMOTE_MAGIC) ? r : nullptr;
}

void put_u64(std::string &s, uint64_t v) {
    for (int i = 0; i < 8; i++) s.push_back(static_cast<char>(v >> (8 * i)));
}
void put_u32(std::string &s, uint32_t v) {
    for (int i = 0; i < 4; i++) s.push_back(static_cast<char>(v >> (8 * i)));
}
uint64_t get_le(const uint8_t *p, int n) {
    uint64_t v = 0;
    for (int i = 0; i < n; i++) v |= uint64_t(p[i]) << (8 * i);
    return v;
}

// One long message being reassembled.
struct Partial {
    std::vector<std::string> pieces;
    size_t have = 0;
    size_t bytes = 0;
    uint64_t order = 0; // arrival order, to drop the oldest
};

// Drops the oldest unfinished messages of one connection (never `keep`,
// the one a piece just joined) while they hold more than the bound.
void drop_oldest_past_bytes(std::map<uint64_t, Partial> &mine, uint64_t keep,
                            const std::string &who) {
    for (;;) {
        size_t total = 0;
        auto oldest = mine.end();
        for (auto j = mine.begin(); j != mine.end(); ++j) {
            total += j->second.bytes;
            if (j->first != keep && (oldest == mine.end() || j->second.order < oldest->second.order))
                oldest = j;
        }
        if (total <= MAX_PARTIAL_BYTES_PER_CONN || oldest == mine.end()) return;
        std::fprintf(stderr, "ferry nixl: %s holds %zu bytes of unfinished long messages: the "
                             "oldest is dropped\n", who.c_str(), total);
        mine.erase(oldest);
    }
}

class nixlFerryEngine : public nixlBackendEngine {
public:
    explicit nixlFerryEngine(const nixlBackendInitParams *p) : nixlBackendEngine(p) {
        initErr = !start(p);
    }

    ~nixlFerryEngine() override {
        std::lock_guard<std::mutex> g(mu_);
        for (auto &c : conns_) ferry_remove_remote(ep_, c.first);
        ferry_endpoint_destroy(ep_);
    }

    bool supportsRemote() const override { return true; }
    // Same-agent transfers would need a ferry connection of an endpoint to
    // itself, which ferry's same-host handshake does not make (both rings
    // of the pair get one name); NIXL routes them to a backend that does.
    bool supportsLocal() const override { return false; }
    bool supportsNotif() const override { return true; }
    nixl_mem_list_t getSupportedMems() const override { return {DRAM_SEG, VRAM_SEG}; }

    nixl_status_t
    registerMem(const nixlBlobDesc &mem, const nixl_mem_t &kind, nixlBackendMD *&out) override {
        if (kind != DRAM_SEG && kind != VRAM_SEG) return NIXL_ERR_NOT_SUPPORTED;
        auto md = std::make_unique<LocalMD>();
        int32_t rc = ferry_register(ep_, reinterpret_cast<void *>(mem.addr), mem.len, 0, &md->region);
        if (rc != FERRY_OK) {
            log_failure("register", rc);
            return to_nixl(rc);
        }
        md->base = mem.addr;
        md->len = mem.len;
        uint8_t w[FERRY_WINDOW_LEN];
        rc = ferry_advertise(ep_, FERRY_ANY_CONN, md->region, 0, mem.len, w, sizeof w);
        if (rc != FERRY_OK) {
            log_failure("advertise", rc);
            ferry_deregister(md->region);
            return to_nixl(rc);
        }
        md->public_data = "F";
        md->public_data.append(reinterpret_cast<const char *>(w), sizeof w);
        if (kind == VRAM_SEG) {
            uint8_t iw[FERRY_IPC_WINDOW_LEN];
            rc = ferry_advertise_ipc(ep_, FERRY_ANY_CONN, md->region, 0, mem.len, iw, sizeof iw);
            if (rc == FERRY_OK)
                md->public_data.append(reinterpret_cast<const char *>(iw), sizeof iw);
            else
                log_failure("advertise_ipc (same-host peers copy through ferry's shm path)", rc);
        }
        out = md.release();
        return NIXL_SUCCESS;
    }

    nixl_status_t deregisterMem(nixlBackendMD *meta) override {
        auto *md = const_cast<LocalMD *>(as_local(meta));
        if (md == nullptr) return NIXL_ERR_INVALID_PARAM;
        // Waits for transfers still holding the region (released in flight).
        int32_t rc = ferry_deregister(md->region);
        delete md;
        return to_nixl(rc);
    }

    nixl_status_t connect(const std::string &agent) override {
        uint64_t c;
        return conn_for(agent, c);
    }

    nixl_status_t disconnect(const std::string &agent) override {
        std::lock_guard<std::mutex> g(mu_);
        auto it = by_agent_.find(agent);
        if (it == by_agent_.end()) return NIXL_SUCCESS;
        uint64_t c = it->second;
        by_agent_.erase(it);
        conns_.erase(c);
        partial_.erase(c);
        ferry_remove_remote(ep_, c);
        return NIXL_SUCCESS;
    }

    nixl_status_t unloadMD(nixlBackendMD *input) override {
        auto *r = const_cast<RemoteMD *>(as_remote(input));
        if (r == nullptr) return NIXL_ERR_INVALID_PARAM;
        delete r;
        return NIXL_SUCCESS;
    }

    nixl_status_t prepXfer(const nixl_xfer_op_t &op, const nixl_meta_dlist_t &local,
                           const nixl_meta_dlist_t &remote, const std::string &agent,
                           nixlBackendReqH *&handle, const nixl_opt_b_args_t *) const override {
        if (local.descCount() != remote.descCount() || local.descCount() == 0)
            return NIXL_ERR_MISMATCH;
        // GPU memory of a same-host peer: its IPC windows, if every
        // descriptor has one (FERRY_NIXL_IPC=0: never).
        bool ipc = ipc_allowed_;
        for (size_t i = 0; ipc && i < remote.descCount(); i++) {
            const RemoteMD *rm = as_remote(remote[i].metadataP);
            ipc = rm != nullptr && !rm->ipc.empty();
        }
        if (ipc) {
            uint64_t conn;
            int is_local = 0;
            ipc = conn_for(agent, conn) == NIXL_SUCCESS &&
                  ferry_peer_is_local(ep_, conn, &is_local) == FERRY_OK && is_local == 1;
        }
        auto h = std::make_unique<ReqH>();
        h->op = op == NIXL_READ ? FERRY_READ : FERRY_WRITE;
        h->ipc = ipc;
        h->agent = agent;
        h->descs.reserve(local.descCount());
        for (size_t i = 0; i < local.descCount(); i++) {
            const nixlMetaDesc &l = local[i];
            const nixlMetaDesc &r = remote[i];
            const LocalMD *lm = as_local(l.metadataP);
            const RemoteMD *rm = as_remote(r.metadataP);
            if (lm == nullptr || rm == nullptr || l.len != r.len) return NIXL_ERR_INVALID_PARAM;
            if (rm->agent != agent) return NIXL_ERR_INVALID_PARAM;
            // Ranges outside a registration are refused here; ferry checks
            // again (and the peer checks its own window).
            if (l.addr < lm->base || l.addr - lm->base > lm->len || l.len > lm->len - (l.addr - lm->base))
                return NIXL_ERR_INVALID_PARAM;
            if (r.addr < rm->base || r.addr - rm->base > rm->len || r.len > rm->len - (r.addr - rm->base))
                return NIXL_ERR_INVALID_PARAM;
            const std::string &w = ipc ? rm->ipc : rm->window;
            h->descs.push_back(ferry_desc{lm->region, l.addr - lm->base, l.len,
                                          reinterpret_cast<const uint8_t *>(w.data()), w.size(),
                                          r.addr - rm->base});
        }
        handle = h.release();
        return NIXL_SUCCESS;
    }

    nixl_status_t postXfer(const nixl_xfer_op_t &, const nixl_meta_dlist_t &,
                           const nixl_meta_dlist_t &, const std::string &, nixlBackendReqH *&handle,
                           const nixl_opt_b_args_t *opt) const override {
        auto *h = as_req(handle);
        if (h == nullptr) return NIXL_ERR_INVALID_PARAM;
        if (h->t != nullptr) {
            if (ferry_transfer_poll(h->t) == FERRY_PENDING) return NIXL_ERR_REPOST_ACTIVE;
            ferry_transfer_release(h->t);
            h->t = nullptr;
        }
        uint64_t conn;
        nixl_status_t st = conn_for(h->agent, conn);
        if (st != NIXL_SUCCESS) return st;
        std::string note;
        if (opt != nullptr && opt->hasNotif) {
            if (opt->notifMsg.size() > MAX_NOTIF_BYTES) return NIXL_ERR_INVALID_PARAM;
            // A long message's leading pieces go first; the last one rides
            // on the transfer, so the message is whole only once its data is.
            st = send_leading_pieces(conn, opt->notifMsg, note);
            if (st != NIXL_SUCCESS) return st;
        }
        if (h->prep != nullptr && h->prep_conn != conn) {
            ferry_prepared_free(h->prep);
            h->prep = nullptr;
        }
        const uint8_t *nb = note.empty() ? nullptr : reinterpret_cast<const uint8_t *>(note.data());
        int32_t rc = FERRY_OK;
        if (h->prep == nullptr && (h->ipc || h->posts > 0)) {
            rc = ferry_prepare(ep_, conn, h->op, h->descs.data(), h->descs.size(), &h->prep);
            if (rc == FERRY_OK) h->prep_conn = conn;
            else h->prep = nullptr;
        }
        if (rc == FERRY_OK)
            rc = h->prep != nullptr
                     ? ferry_post_prepared(h->prep, nb, note.size(), &h->t)
                     : ferry_post(ep_, conn, h->op, h->descs.data(), h->descs.size(), nb, note.size(), &h->t);
        h->posts++;
        if (rc != FERRY_OK) {
            h->t = nullptr;
            log_failure("post", rc);
            forget_if_gone(rc, conn);
            return to_nixl(rc);
        }
        return NIXL_IN_PROG;
    }

    nixl_status_t checkXfer(nixlBackendReqH *handle) const override {
        auto *h = as_req(handle);
        if (h == nullptr || h->t == nullptr) return NIXL_ERR_INVALID_PARAM;
        int32_t rc = ferry_transfer_poll(h->t);
        if (rc < 0) forget_if_gone(rc, known_conn(h->agent));
        return to_nixl(rc);
    }

    nixl_status_t releaseReqH(nixlBackendReqH *handle) const override {
        auto *h = as_req(handle);
        if (h == nullptr) return NIXL_ERR_INVALID_PARAM;
        if (h->t != nullptr) {
            // In flight: withdraw its notification; bytes already on the
            // wire still land, and ferry keeps the regions registered until
            // they did (deregisterMem waits for them).
            if (ferry_transfer_poll(h->t) == FERRY_PENDING) ferry_transfer_cancel(h->t);
            ferry_transfer_release(h->t);
        }
        ferry_prepared_free(h->prep);
        h->magic = 0;
        delete h;
        return NIXL_SUCCESS;
    }

    nixl_status_t getPublicData(const nixlBackendMD *meta, std::string &str) const override {
        const LocalMD *md = as_local(meta);
        if (md == nullptr) return NIXL_ERR_INVALID_PARAM;
        str = md->public_data;
        return NIXL_SUCCESS;
    }

    nixl_status_t getConnInfo(std::string &str) const override {
        str = conn_info_;
        return NIXL_SUCCESS;
    }

    nixl_status_t loadRemoteConnInfo(const std::string &agent, const std::string &info) override {
        if (info.empty()) return NIXL_ERR_INVALID_PARAM;
        uint64_t holder = FERRY_ANY_CONN;
        {
            std::lock_guard<std::mutex> g(mu_);
            meta_[agent] = info;
            auto it = claimed_.find(agent);
            if (it != claimed_.end() && proven_.count(it->second) == 0) holder = it->second;
        }
        // A peer that claimed this name before we knew where the agent
        // lives: proven now, or dropped.
        if (holder != FERRY_ANY_CONN) prove_or_drop(holder, agent, info);
        return NIXL_SUCCESS;
    }

    nixl_status_t loadRemoteMD(const nixlBlobDesc &in, const nixl_mem_t &kind,
                               const std::string &agent, nixlBackendMD *&out) override {
        if (kind != DRAM_SEG && kind != VRAM_SEG) return NIXL_ERR_NOT_SUPPORTED;
        const std::string &pd = in.metaInfo;
        bool with_ipc = pd.size() == 1 + FERRY_WINDOW_LEN + FERRY_IPC_WINDOW_LEN;
        if ((pd.size() != 1 + FERRY_WINDOW_LEN && !with_ipc) || pd[0] != 'F') {
            std::fprintf(stderr, "ferry nixl: %s's metadata for [%#zx, +%zu) is not ferry's "
                                 "(%zu bytes)\n", agent.c_str(), size_t(in.addr), in.len, pd.size());
            return NIXL_ERR_INVALID_PARAM;
        }
        auto md = std::make_unique<RemoteMD>();
        md->agent = agent;
        md->base = in.addr;
        md->len = in.len;
        md->window = pd.substr(1, FERRY_WINDOW_LEN);
        if (with_ipc) md->ipc = pd.substr(1 + FERRY_WINDOW_LEN);
        out = md.release();
        return NIXL_SUCCESS;
    }

    nixl_status_t getNotifs(notif_list_t &list) override;

    nixl_status_t genNotif(const std::string &agent, const std::string &msg) const override {
        if (msg.size() > MAX_NOTIF_BYTES) return NIXL_ERR_INVALID_PARAM;
        uint64_t conn;
        nixl_status_t st = conn_for(agent, conn);
        if (st != NIXL_SUCCESS) return st;
        std::string last;
        st = send_leading_pieces(conn, msg, last);
        if (st != NIXL_SUCCESS) return st;
        return send_note(conn, last, msg.size() > WHOLE_MAX);
    }

private:
    bool start(const nixlBackendInitParams *p);
    nixl_status_t conn_for(const std::string &agent, uint64_t &conn) const;
    nixl_status_t send_leading_pieces(uint64_t conn, const std::string &msg, std::string &last) const;
    nixl_status_t send_note(uint64_t conn, const std::string &note, bool wait_for_room = false) const;
    void take(uint64_t conn, const uint8_t *p, size_t n, notif_list_t &list);
    bool hello(uint64_t conn, const std::string &agent);
    bool proven_hello(uint64_t conn, const std::string &agent, const std::string &meta);
    bool vouched(uint64_t conn, const std::string &agent, const std::string &meta) const;
    void prove_or_drop(uint64_t conn, const std::string &agent, const std::string &meta);
    void forget_locked(uint64_t conn) const;

    static ReqH *as_req(nixlBackendReqH *h) {
        auto *r = static_cast<ReqH *>(h);
        return (r != nullptr && r->magic == REQ_MAGIC) ? r : nullptr;
    }

    uint64_t known_conn(const std::string &agent) const {
        std::lock_guard<std::mutex> g(mu_);
        auto it = by_agent_.find(agent);
        return it == by_agent_.end() ? FERRY_ANY_CONN : it->second;
    }

    // A connection ferry reports gone is forgotten, so the next use
    // connects again (or fails: the peer is gone).
    void forget_if_gone(int32_t rc, uint64_t conn) const {
        bool dead = rc == FERRY_ERR_DISCONNECTED || rc == FERRY_ERR_PEER_TIMEOUT ||
                    rc == FERRY_ERR_PEER_MISBEHAVED;
        if (!dead || conn == FERRY_ANY_CONN) return;
        std::lock_guard<std::mutex> g(mu_);
        auto it = conns_.find(conn);
        if (it == conns_.end()) return;
        auto a = by_agent_.find(it->second);
        if (a != by_agent_.end() && a->second == conn) by_agent_.erase(a);
        forget_locked(conn);
    }

    ferry_endpoint *ep_ = nullptr;
    std::string conn_info_;
    bool ipc_allowed_ = true;
    mutable std::mutex mu_;
    // Under mu_: conn info by agent; the connection we opened to each agent
    // (to the conn info NIXL loaded: the only ones our transfers and
    // notifications go over); the connection each peer's hello claimed a
    // name on (what its notifications are reported as from); agent by
    // connection (both kinds); long messages being reassembled.
    mutable std::unordered_map<std::string, std::string> meta_;
    mutable std::unordered_map<std::string, uint64_t> by_agent_;
    mutable std::unordered_map<std::string, uint64_t> claimed_;
    mutable std::unordered_map<uint64_t, std::string> conns_;
    // Accepted connections whose name was vouched for (a subset of conns_).
    mutable std::unordered_set<uint64_t> proven_;
    // Unproven names taken so far, as far as the log says (MAX_UNPROVEN_SAID).
    size_t unproven_said_ = 0;
    mutable std::unordered_map<uint64_t, std::map<uint64_t, Partial>> partial_;
    mutable uint64_t next_msg_id_ = 1;
    uint64_t arrivals_ = 0;
};

bool nixlFerryEngine::start(const nixlBackendInitParams *p) {
    const char *ipc = std::getenv("FERRY_NIXL_IPC");
    ipc_allowed_ = ipc == nullptr || std::string(ipc) != "0";
    ferry_config *cfg = ferry_config_new();
    // NIXL's users poll (checkXfer, getNotifs) from their own threads: let
    // those polls run ferry's shards (helpers run them otherwise), unless
    // FERRY_DRIVE says otherwise (environment or backend parameter).
    bool drive_set = std::getenv("FERRY_DRIVE") != nullptr ||
                     (p->customParams != nullptr && p->customParams->count("FERRY_DRIVE") != 0);
    if (!drive_set) ferry_config_set(cfg, "FERRY_DRIVE", "caller");
    if (p->customParams != nullptr) {
        for (auto &kv : *p->customParams) {
            // ferry's own settings by their names; NIXL's are not ours.
            if (kv.first.rfind("FERRY_", 0) == 0 && !kv.second.empty())
                ferry_config_set(cfg, kv.first.c_str(), kv.second.c_str());
        }
    }
    int32_t rc = ferry_endpoint_create(cfg, &ep_);
    ferry_config_free(cfg);
    if (rc != FERRY_OK) {
        log_failure("endpoint_create", rc);
        ep_ = nullptr;
        return false;
    }
    size_t len = 0;
    ferry_endpoint_metadata(ep_, nullptr, 0, &len);
    conn_info_.assign(len, '\0');
    rc = ferry_endpoint_metadata(ep_, reinterpret_cast<uint8_t *>(conn_info_.data()), len, &len);
    if (rc == FERRY_OK) rc = ferry_start_passive_accept(ep_);
    if (rc != FERRY_OK) {
        log_failure("endpoint metadata / accept", rc);
        return false;
    }
    return true;
}

nixl_status_t nixlFerryEngine::conn_for(const std::string &agent, uint64_t &conn) const {
    std::string meta;
    {
        std::lock_guard<std::mutex> g(mu_);
        auto it = by_agent_.find(agent);
        if (it != by_agent_.end()) {
            conn = it->second;
            return NIXL_SUCCESS;
        }
        auto m = meta_.find(agent);
        if (m == meta_.end()) return NIXL_ERR_NOT_FOUND;
        meta = m->second;
    }
    // Connecting blocks (with ferry's deadline); not under the lock.
    uint64_t c;
    int32_t rc = ferry_add_remote(ep_, reinterpret_cast<const uint8_t *>(meta.data()), meta.size(), &c);
    if (rc != FERRY_OK) {
        log_failure("connect", rc);
        return rc == FERRY_ERR_INVALID ? NIXL_ERR_INVALID_PARAM : NIXL_ERR_REMOTE_DISCONNECT;
    }
    std::string hello = "H" + localAgent;
    rc = ferry_send_notification(ep_, c, reinterpret_cast<const uint8_t *>(hello.data()), hello.size());
    if (rc != FERRY_OK) {
        log_failure("hello", rc);
        ferry_remove_remote(ep_, c);
        return to_nixl(rc);
    }
    std::lock_guard<std::mutex> g(mu_);
    auto won = by_agent_.emplace(agent, c);
    conns_[c] = agent;
    conn = won.first->second; // another thread's, if it connected first
    return NIXL_SUCCESS;
}

nixl_status_t
nixlFerryEngine::send_leading_pieces(uint64_t conn, const std::string &msg, std::string &last) const {
    if (msg.size() <= WHOLE_MAX) {
        last = "N" + msg;
        return NIXL_SUCCESS;
    }
    uint64_t id;
    {
        std::lock_guard<std::mutex> g(mu_);
        id = next_msg_id_++;
    }
    uint32_t count = uint32_t((msg.size() + PIECE_MAX - 1) / PIECE_MAX);
    for (uint32_t i = 0; i < count; i++) {
        std::string piece = "L";
        put_u64(piece, id);
        put_u32(piece, i);
        put_u32(piece, count);
        piece.append(msg, size_t(i) * PIECE_MAX, PIECE_MAX);
        if (i + 1 == count) {
            last = std::move(piece);
            break;
        }
        nixl_status_t st = send_note(conn, piece, i > 0);
        if (st != NIXL_SUCCESS) return st;
    }
    return NIXL_SUCCESS;
}

nixl_status_t nixlFerryEngine::send_note(uint64_t conn, const std::string &note, bool wait_for_room) const {
    auto deadline = std::chrono::steady_clock::now() + PIECE_ROOM_WAIT;
    int32_t rc;
    for (;;) {
        rc = ferry_send_notification(ep_, conn, reinterpret_cast<const uint8_t *>(note.data()), note.size());
        if (rc != FERRY_ERR_BUSY || !wait_for_room || std::chrono::steady_clock::now() >= deadline) break;
        std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    if (rc != FERRY_OK) {
        log_failure("notification", rc);
        forget_if_gone(rc, conn);
    }
    return to_nixl(rc);
}

nixl_status_t nixlFerryEngine::getNotifs(notif_list_t &list) {
    // NIXL's users call this in their polling loops: one buffer per thread,
    // not an allocation per call.
    thread_local std::vector<uint8_t> buf(FERRY_MAX_NOTIFY);
    for (int i = 0; i < MAX_NOTIFS_PER_CALL; i++) {
        uint64_t conn = 0;
        size_t len = 0;
        int32_t rc = ferry_recv_notification(ep_, 0, &conn, buf.data(), buf.size(), &len);
        if (rc == FERRY_ERR_TIMEOUT) break;
        if (rc != FERRY_OK) {
            log_failure("recv_notification", rc);
            return to_nixl(rc);
        }
        if (len > 0) take(conn, buf.data(), len, list);
    }
    return NIXL_SUCCESS;
}

namespace {
bool valid_utf8(const std::string &s) {
    size_t i = 0;
    while (i < s.size()) {
        unsigned char c = static_cast<unsigned char>(s[i]);
        size_t len = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 0;
        if (len == 0 || i + len > s.size()) return false;
        uint32_t cp = len == 1 ? c : c & (0x7F >> len);
        for (size_t k = 1; k < len; k++) {
            unsigned char d = static_cast<unsigned char>(s[i + k]);
            if ((d >> 6) != 0x2) return false;
            cp = (cp << 6) | (d & 0x3F);
        }
        // No overlong forms, no surrogates, nothing past U+10FFFF.
        static const uint32_t min_of[] = {0, 0, 0x80, 0x800, 0x10000};
        if (cp < min_of[len] || (cp >= 0xD800 && cp <= 0xDFFF) || cp > 0x10FFFF) return false;
        i += len;
    }
    return true;
}
} // namespace

// Under mu_: `conn` no longer carries a name (its claim, its partial
// messages, its proof go).
void nixlFerryEngine::forget_locked(uint64_t conn) const {
    auto it = conns_.find(conn);
    if (it != conns_.end()) {
        auto cl = claimed_.find(it->second);
        if (cl != claimed_.end() && cl->second == conn) claimed_.erase(cl);
        conns_.erase(it);
    }
    partial_.erase(conn);
    proven_.erase(conn);
}

// Whether the agent whose conn info is `meta` dialed `conn` to us.
bool nixlFerryEngine::vouched(uint64_t conn, const std::string &agent,
                              const std::string &meta) const {
    int32_t yes = 0;
    int32_t rc = ferry_vouch(ep_, conn, reinterpret_cast<const uint8_t *>(meta.data()), meta.size(),
                             &yes);
    if (rc != FERRY_OK) {
        std::fprintf(stderr, "ferry nixl: %s could not vouch for connection %llu (%d): %s\n",
                     agent.c_str(), (unsigned long long)conn, rc, ferry_last_error());
        return false;
    }
    if (yes == 0)
        std::fprintf(stderr, "ferry nixl: connection %llu claims %s, which did not dial it\n",
                     (unsigned long long)conn, agent.c_str());
    return yes != 0;
}

// A connection holding `agent`'s name unproven: proven now, or dropped.
void nixlFerryEngine::prove_or_drop(uint64_t conn, const std::string &agent,
                                    const std::string &meta) {
    bool ok = vouched(conn, agent, meta);
    {
        std::lock_guard<std::mutex> g(mu_);
        if (ok) {
            if (conns_.count(conn) != 0) proven_.insert(conn);
            return;
        }
        forget_locked(conn);
    }
    ferry_remove_remote(ep_, conn);
}

// A peer's hello on `conn`: `agent` is what its notifications are reported
// as from. Refused (false: the caller drops the connection) for a name that
// is empty, too long or not UTF-8, a second hello on one connection, a
// name whose conn info we loaded and whose agent does not vouch for this
// connection, a name another live connection holds unproven, or past
// MAX_CLAIMS. A claim never steers our own traffic: that goes over
// connections we opened.
bool nixlFerryEngine::hello(uint64_t conn, const std::string &agent) {
    if (agent.empty() || agent.size() > MAX_AGENT_NAME || !valid_utf8(agent)) {
        std::fprintf(stderr, "ferry nixl: a hello with a bad name (%zu bytes) on connection "
                             "%llu: dropped\n", agent.size(), (unsigned long long)conn);
        return false;
    }
    std::string meta;
    {
        std::lock_guard<std::mutex> g(mu_);
        auto mine = conns_.find(conn);
        if (mine != conns_.end()) return mine->second == agent; // once per connection
        auto m = meta_.find(agent);
        if (m != meta_.end()) meta = m->second;
    }
    if (!meta.empty()) return proven_hello(conn, agent, meta);
    uint64_t holder;
    {
        std::lock_guard<std::mutex> g(mu_);
        auto it = claimed_.find(agent);
        if (it == claimed_.end()) {
            if (claimed_.size() >= MAX_CLAIMS) return false;
            claimed_.emplace(agent, conn);
            conns_[conn] = agent;
            // Said, not proven: NIXL loaded nothing to check it against.
            if (unproven_said_ < MAX_UNPROVEN_SAID) {
                unproven_said_++;
                std::fprintf(stderr, "ferry nixl: connection %llu says it is %s, whose conn info is "
                                     "not loaded: taken unproven until it is%s\n",
                             (unsigned long long)conn, agent.c_str(),
                             unproven_said_ == MAX_UNPROVEN_SAID ? " (further ones not logged)" : "");
            }
            return true;
        }
        holder = it->second;
    }
    // Held: by a connection still alive, the claim is a lie; a dead one's
    // name is free again (its agent came back).
    int32_t local = 0;
    bool alive = ferry_peer_is_local(ep_, holder, &local) == FERRY_OK;
    std::lock_guard<std::mutex> g(mu_);
    if (alive) {
        std::fprintf(stderr, "ferry nixl: connection %llu claims %s, which connection %llu holds: "
                             "dropped\n", (unsigned long long)conn, agent.c_str(),
                     (unsigned long long)holder);
        return false;
    }
    forget_locked(holder);
    claimed_[agent] = conn;
    conns_[conn] = agent;
    return true;
}

// A hello for an agent whose conn info we loaded: only if that agent
// vouches for `conn`. It then holds the name; a holder before it keeps
// its own (proven) label or, unproven, must prove it or go.
bool nixlFerryEngine::proven_hello(uint64_t conn, const std::string &agent,
                                   const std::string &meta) {
    if (!vouched(conn, agent, meta)) return false;
    uint64_t holder = FERRY_ANY_CONN;
    {
        std::lock_guard<std::mutex> g(mu_);
        auto it = claimed_.find(agent);
        if (it == claimed_.end() && claimed_.size() >= MAX_CLAIMS) return false;
        if (it != claimed_.end() && proven_.count(it->second) == 0) holder = it->second;
        claimed_[agent] = conn;
        conns_[conn] = agent;
        proven_.insert(conn);
    }
    if (holder != FERRY_ANY_CONN) prove_or_drop(holder, agent, meta);
    return true;
}

// One notification from `conn`: a hello, a whole message or a piece.
void nixlFerryEngine::take(uint64_t conn, const uint8_t *p, size_t n, notif_list_t &list) {
    if (p[0] == 'H') {
        std::string agent(reinterpret_cast<const char *>(p + 1), n - 1);
        if (!hello(conn, agent)) ferry_remove_remote(ep_, conn); // a liar: dropped
        return;
    }
    std::lock_guard<std::mutex> g(mu_);
    auto who = conns_.find(conn);
    if (who == conns_.end()) {
        std::fprintf(stderr, "ferry nixl: a notification on connection %llu before its hello: "
                             "dropped\n", (unsigned long long)conn);
        return;
    }
    if (p[0] == 'N') {
        list.emplace_back(who->second, std::string(reinterpret_cast<const char *>(p + 1), n - 1));
        return;
    }
    if (p[0] != 'L' || n < PIECE_HEADER) {
        std::fprintf(stderr, "ferry nixl: a malformed notification from %s: dropped\n",
                     who->second.c_str());
        return;
    }
    uint64_t id = get_le(p + 1, 8);
    uint32_t idx = uint32_t(get_le(p + 9, 4));
    uint32_t count = uint32_t(get_le(p + 13, 4));
    size_t body = n - PIECE_HEADER;
    bool fits = count >= 2 && count <= MAX_PIECES && idx < count &&
                (idx + 1 == count ? body <= PIECE_MAX : body == PIECE_MAX);
    auto &mine = partial_[conn];
    if (!fits) {
        std::fprintf(stderr, "ferry nixl: a bad piece (%u of %u, %zu bytes) from %s: its message "
                             "is dropped\n", idx, count, body, who->second.c_str());
        mine.erase(id);
        return;
    }
    auto it = mine.find(id);
    if (it == mine.end()) {
        if (mine.size() >= MAX_PARTIAL_PER_CONN) {
            auto oldest = mine.begin();
            for (auto j = mine.begin(); j != mine.end(); ++j)
                if (j->second.order < oldest->second.order) oldest = j;
            std::fprintf(stderr, "ferry nixl: %s has %zu unfinished long messages: the oldest is "
                                 "dropped\n", who->second.c_str(), mine.size());
            mine.erase(oldest);
        }
        it = mine.emplace(id, Partial{}).first;
        it->second.pieces.resize(count);
        it->second.order = arrivals_++;
    }
    Partial &m = it->second;
    if (m.pieces.size() != count || !m.pieces[idx].empty()) {
        mine.erase(it);
        return;
    }
    m.pieces[idx].assign(reinterpret_cast<const char *>(p + PIECE_HEADER), body);
    m.bytes += body;
    if (++m.have < count) {
        drop_oldest_past_bytes(mine, id, who->second);
        return;
    }
    std::string whole;
    for (auto &s : m.pieces) whole += s;
    list.emplace_back(who->second, std::move(whole));
    mine.erase(it);
}

nixlBackendEngine *create_engine(const nixlBackendInitParams *p) {
    try {
        return new nixlFerryEngine(p);
    } catch (const std::exception &e) {
        std::fprintf(stderr, "ferry nixl: the engine could not start: %s\n", e.what());
        return nullptr;
    }
}

void destroy_engine(nixlBackendEngine *e) { delete e; }
const char *plugin_name() { return "FERRY"; }
const char *plugin_version() { return "0.1.0"; }
nixl_b_params_t backend_options() { return {}; }
nixl_mem_list_t backend_mems() { return {DRAM_SEG, VRAM_SEG}; }

nixlBackendPlugin plugin = {NIXL_PLUGIN_API_VERSION, create_engine, destroy_engine, plugin_name,
                            plugin_version, backend_options, backend_mems};

} // namespace

// Called by nixl/src/lib.rs's nixl_plugin_init / nixl_plugin_fini (the
// exported names: a Rust cdylib exports what Rust defines).
extern "C" void *ferry_nixl_plugin_record() { return &plugin; }
