/*
 * softverbs: a software RDMA NIC that *is* libibverbs.so.1.
 *
 * A process that finds this library first on its library path (build it
 * with tools/softverbs/build, then LD_LIBRARY_PATH=target/softverbs) sees
 * RDMA devices, opens them, registers memory, creates completion queues
 * and RC queue pairs, and moves bytes with one-sided RDMA WRITE and READ
 * between processes of one host. rdma-mummy-sys dlopens
 * "libibverbs.so.1" with RTLD_LOCAL, so an LD_PRELOAD shim would not be
 * seen; this library replaces the whole thing.
 *
 * It is built against rdma-core's own headers (the copy inside
 * rdma-mummy-sys), so every struct the caller reads or writes directly --
 * ibv_qp_ex's posting hooks, ibv_cq_ex's polling hooks, verbs_context's
 * extended ops -- has rdma-core's layout.
 *
 * What it models (and the tests rely on):
 *  - devices: SOFTVERBS_DEVICES=name[,name...] (default "softverbs0"),
 *    link layer SOFTVERBS_LINK_LAYER=ethernet|infiniband, ports listed in
 *    SOFTVERBS_PORT_DOWN are DOWN. A GID table like mlx5's RoCE ports
 *    (0: link-local RoCE v1, 1: link-local RoCE v2, 2: IPv4-mapped v1,
 *    3: IPv4-mapped v2), or one IB GID and a LID. A sysfs tree that says
 *    the same (ibv_get_sysfs_path() returns it, as libibverbs returns
 *    $SYSFS_PATH or /sys).
 *  - one shared table per user (/dev/shm/softverbs-<uid>) of queue pairs
 *    and memory regions, so a NIC engine in one process can find a peer's
 *    QP by number and its memory by rkey; the engine (one thread per
 *    process, the "hardware") executes WRITE and READ with
 *    process_vm_writev/readv against the target process, after the checks
 *    a responder makes: QP state (RTR or RTS), address (GID/LID and RoCE
 *    version), starting PSN, QP access flags, READ depth, rkey, protection
 *    domain, bounds and MR access.
 *  - RC semantics: work requests of a QP execute and complete in order;
 *    only signalled ones complete when they succeed; send-queue slots are
 *    freed only when a later completion is polled; the first failure moves
 *    the QP to the error state, completes that WR with its status
 *    (signalled or not) and flushes every later one with WR_FLUSH_ERR
 *    (signalled or not, as mlx5 reports them); a peer QP that is not ready,
 *    gone or unreachable is retried for timeout x retry_cnt, then
 *    RETRY_EXC_ERR; a remote access or request error moves the responder's
 *    QP to error too.
 *  - modify_qp's RC state machine with rdma-core's required and optional
 *    attribute masks; EINVAL for anything else.
 *  - fault injection: SOFTVERBS_FAIL=point[,point...] with points open,
 *    reg_mr, create_cq, create_qp, init, rtr, rts, post, destroy_qp,
 *    destroy_cq (EBUSY; the object is leaked);
 *    SOFTVERBS_MEMLOCK_BYTES caps the bytes a process may register
 *    (ENOMEM beyond, as RLIMIT_MEMLOCK does); SOFTVERBS_ROUTED=1 makes
 *    link-local and RoCE v1 GIDs unreachable between devices (a routed
 *    RoCE v2 fabric); SOFTVERBS_MAX_QP_RD_ATOM sets the device's READ
 *    depth caps; SOFTVERBS_RETRY_MS caps the retry window.
 *
 * Asynchronous events (ibv_get_async_event; non-blocking when the
 * context's async_fd is O_NONBLOCK): IBV_EVENT_QP_ACCESS_ERR for a QP a
 * peer's request moved to the error state (the responder's side), and
 * IBV_EVENT_PORT_ERR / IBV_EVENT_PORT_ACTIVE when a port's state changes.
 *
 * Test hooks (not libibverbs; found with dlsym on the loaded library):
 * softverbs_device_wrs(name) counts the work requests this process's
 * queue pairs on device `name` executed successfully;
 * softverbs_set_port(name, up) takes a port down or up for every process
 * of the host (work requests through it then fail as on a dead link).
 *
 * Inline data: up to 64 bytes per WRITE (cap.max_inline_data), copied at
 * post time; softverbs_inline_wrs() counts the inline WRITEs executed,
 * softverbs_live_cqs() the completion queues this process holds.
 *
 * Not modelled: SEND/RECV, atomics, memory windows, UD/UC,
 * completion channels and events, dma-buf registration (EOPNOTSUPP, as on
 * a NIC without it).
 */
#define _GNU_SOURCE
#include <infiniband/driver.h>
#include <infiniband/verbs.h>

#include <endian.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#undef ibv_reg_mr
#undef ibv_reg_mr_iova
#undef ibv_query_port
#undef ibv_get_device_list

#define SV_EXPORT __attribute__((visibility("default")))
#define SV_MAX_DEVICES 8
#define SV_GIDS 4
#define SV_QP_SLOTS 65536u
#define SV_MR_SLOTS 65536u
#define SV_MAX_SGE 16
#define SV_MAX_QP_WR 32768
#define SV_MAX_CQE (1 << 22)
#define SV_MAX_MSG (1u << 31)
#define SV_MAX_INLINE 64

/* ---------------------------------------------------------------- config */

static int listed(const char *list, const char *name);

static int fail_at(const char *point)
{
	return listed(getenv("SOFTVERBS_FAIL"), point);
}

static long env_long(const char *name, long dflt)
{
	const char *s = getenv(name);
	if (!s || !*s)
		return dflt;
	return strtol(s, NULL, 0);
}

static uint64_t now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* --------------------------------------------------------------- devices */

struct sv_device {
	struct ibv_device dev;
	int idx;
	int infiniband;
	int port_down;
	uint64_t guid;
	uint16_t lid;
	int ngids;
	union ibv_gid gids[SV_GIDS];
	enum ibv_gid_type_sysfs gid_types[SV_GIDS];
};

static struct sv_device g_devs[SV_MAX_DEVICES];
static int port_is_down(const struct sv_device *d);
static _Atomic uint64_t g_dev_wrs[SV_MAX_DEVICES];
static _Atomic uint64_t g_inline_wrs;
static _Atomic int64_t g_live_cqs;
static int g_ndevs;
static char g_sysfs[256];
static pthread_once_t g_once = PTHREAD_ONCE_INIT;

static int listed(const char *list, const char *name)
{
	size_t n = strlen(name);
	while (list && *list) {
		const char *e = strchr(list, ',');
		size_t len = e ? (size_t)(e - list) : strlen(list);
		if (len == n && memcmp(list, name, n) == 0)
			return 1;
		list = e ? e + 1 : NULL;
	}
	return 0;
}

/* The GID table of device `idx`: a pure function of its index and link
 * layer, so every process computes the same one. */
static void fill_gids(struct sv_device *d)
{
	memset(d->gids, 0, sizeof(d->gids));
	union ibv_gid ll;
	memset(&ll, 0, sizeof(ll));
	ll.raw[0] = 0xfe;
	ll.raw[1] = 0x80;
	uint64_t g = htobe64(d->guid);
	memcpy(&ll.raw[8], &g, 8);
	if (d->infiniband) {
		d->ngids = 1;
		d->gids[0] = ll;
		d->gid_types[0] = IBV_GID_TYPE_SYSFS_IB_ROCE_V1;
		return;
	}
	union ibv_gid v4;
	memset(&v4, 0, sizeof(v4));
	v4.raw[10] = 0xff;
	v4.raw[11] = 0xff;
	v4.raw[12] = 127;
	v4.raw[13] = 0;
	v4.raw[14] = (uint8_t)d->idx;
	v4.raw[15] = 1;
	d->ngids = 4;
	d->gids[0] = ll;
	d->gid_types[0] = IBV_GID_TYPE_SYSFS_IB_ROCE_V1;
	d->gids[1] = ll;
	d->gid_types[1] = IBV_GID_TYPE_SYSFS_ROCE_V2;
	d->gids[2] = v4;
	d->gid_types[2] = IBV_GID_TYPE_SYSFS_IB_ROCE_V1;
	d->gids[3] = v4;
	d->gid_types[3] = IBV_GID_TYPE_SYSFS_ROCE_V2;
}

static void write_file(const char *path, const char *text)
{
	char tmp[512];
	snprintf(tmp, sizeof(tmp), "%s.%d", path, (int)getpid());
	FILE *f = fopen(tmp, "w");
	if (!f)
		return;
	fputs(text, f);
	fclose(f);
	rename(tmp, path);
}

static void mkdirs(const char *path)
{
	char p[512];
	snprintf(p, sizeof(p), "%s", path);
	for (char *s = p + 1; *s; s++) {
		if (*s == '/') {
			*s = 0;
			mkdir(p, 0700);
			*s = '/';
		}
	}
	mkdir(p, 0700);
}

static void gid_text(const union ibv_gid *g, char *out, size_t n)
{
	snprintf(out, n, "%02x%02x:%02x%02x:%02x%02x:%02x%02x:%02x%02x:%02x%02x:%02x%02x:%02x%02x\n",
		 g->raw[0], g->raw[1], g->raw[2], g->raw[3], g->raw[4], g->raw[5], g->raw[6],
		 g->raw[7], g->raw[8], g->raw[9], g->raw[10], g->raw[11], g->raw[12], g->raw[13],
		 g->raw[14], g->raw[15]);
}

/* A sysfs tree for the devices, where ferry (and rdma-core) look: class/
 * infiniband/<dev>/{device -> a PCI function, ports/1/{state, link_layer,
 * gids/N, gid_attrs/types/N}}. Its path depends only on the
 * configuration, so processes with the same one share it. */
static void make_sysfs(void)
{
	const char *given = getenv("SYSFS_PATH");
	if (given && *given) {
		snprintf(g_sysfs, sizeof(g_sysfs), "%s", given);
		return;
	}
	uint64_t h = 1469598103934665603ull;
	for (int i = 0; i < g_ndevs; i++) {
		const char *s = g_devs[i].dev.name;
		for (; *s; s++)
			h = (h ^ (uint8_t)*s) * 1099511628211ull;
		h = (h ^ (uint64_t)(g_devs[i].infiniband * 2 + g_devs[i].port_down)) *
		    1099511628211ull;
	}
	const char *tmp = getenv("TMPDIR");
	snprintf(g_sysfs, sizeof(g_sysfs), "%s/softverbs-%u/sys-%016llx",
		 tmp && *tmp ? tmp : "/tmp", (unsigned)getuid(), (unsigned long long)h);
	char p[512], q[512], t[128];
	for (int i = 0; i < g_ndevs; i++) {
		struct sv_device *d = &g_devs[i];
		/* Each NIC behind its own bridge of root complex 0000:00. */
		snprintf(p, sizeof(p), "%s/devices/pci0000:00/0000:00:%02x.0/0000:%02x:00.0",
			 g_sysfs, 2 + i, 0x10 + i);
		mkdirs(p);
		snprintf(q, sizeof(q), "%s/class/infiniband/%s/ports/1/gids", g_sysfs, d->dev.name);
		mkdirs(q);
		snprintf(q, sizeof(q), "%s/class/infiniband/%s/ports/1/gid_attrs/types", g_sysfs,
			 d->dev.name);
		mkdirs(q);
		snprintf(q, sizeof(q), "%s/class/infiniband/%s/device", g_sysfs, d->dev.name);
		unlink(q);
		if (symlink(p, q) != 0 && errno != EEXIST)
			perror("softverbs: sysfs link");
		snprintf(q, sizeof(q), "%s/bus/pci/devices", g_sysfs);
		mkdirs(q);
		snprintf(q, sizeof(q), "%s/bus/pci/devices/0000:%02x:00.0", g_sysfs, 0x10 + i);
		unlink(q);
		if (symlink(p, q) != 0 && errno != EEXIST)
			perror("softverbs: sysfs link");
		snprintf(q, sizeof(q), "%s/class/infiniband/%s/ports/1/state", g_sysfs, d->dev.name);
		write_file(q, port_is_down(d) ? "1: DOWN\n" : "4: ACTIVE\n");
		snprintf(q, sizeof(q), "%s/class/infiniband/%s/ports/1/link_layer", g_sysfs,
			 d->dev.name);
		write_file(q, d->infiniband ? "InfiniBand\n" : "Ethernet\n");
		for (int k = 0; k < d->ngids; k++) {
			snprintf(q, sizeof(q), "%s/class/infiniband/%s/ports/1/gids/%d", g_sysfs,
				 d->dev.name, k);
			gid_text(&d->gids[k], t, sizeof(t));
			write_file(q, t);
			snprintf(q, sizeof(q), "%s/class/infiniband/%s/ports/1/gid_attrs/types/%d",
				 g_sysfs, d->dev.name, k);
			write_file(q, d->gid_types[k] == IBV_GID_TYPE_SYSFS_ROCE_V2 ? "RoCE v2\n"
										 : "IB/RoCE v1\n");
		}
	}
}

static void setup_devices(void)
{
	const char *names = getenv("SOFTVERBS_DEVICES");
	if (!names || !*names)
		names = "softverbs0";
	const char *ll = getenv("SOFTVERBS_LINK_LAYER");
	int ib = ll && (strcmp(ll, "infiniband") == 0 || strcmp(ll, "ib") == 0);
	const char *down = getenv("SOFTVERBS_PORT_DOWN");
	const char *s = names;
	while (s && *s && g_ndevs < SV_MAX_DEVICES) {
		const char *e = strchr(s, ',');
		size_t len = e ? (size_t)(e - s) : strlen(s);
		if (len > 0 && len < IBV_SYSFS_NAME_MAX) {
			struct sv_device *d = &g_devs[g_ndevs];
			memset(d, 0, sizeof(*d));
			memcpy(d->dev.name, s, len);
			snprintf(d->dev.dev_name, sizeof(d->dev.dev_name), "uverbs%d", g_ndevs);
			d->dev.node_type = IBV_NODE_CA;
			d->dev.transport_type = IBV_TRANSPORT_IB;
			d->idx = g_ndevs;
			d->infiniband = ib;
			d->port_down = listed(down, d->dev.name);
			d->guid = 0x0002c90300a10000ull + (uint64_t)g_ndevs;
			d->lid = ib ? (uint16_t)(0x100 + g_ndevs) : 0;
			fill_gids(d);
			g_ndevs++;
		}
		s = e ? e + 1 : NULL;
	}
	make_sysfs();
	for (int i = 0; i < g_ndevs; i++) {
		snprintf(g_devs[i].dev.ibdev_path, sizeof(g_devs[i].dev.ibdev_path),
			 "%s/class/infiniband/%s", g_sysfs, g_devs[i].dev.name);
		snprintf(g_devs[i].dev.dev_path, sizeof(g_devs[i].dev.dev_path),
			 "%s/class/infiniband_verbs/%s", g_sysfs, g_devs[i].dev.dev_name);
	}
}

static struct sv_device *device_named(const char *name)
{
	for (int i = 0; i < g_ndevs; i++)
		if (strncmp(g_devs[i].dev.name, name, IBV_SYSFS_NAME_MAX) == 0)
			return &g_devs[i];
	return NULL;
}

/* ------------------------------------------------ the host-wide registry */

/* Published by the owner in this order: fields, then `qpn`/`key` (release);
 * readers load the key (acquire), read, and load it again. */
struct sv_qp_slot {
	_Atomic uint32_t owner; /* pid, 0 when free */
	_Atomic uint32_t qpn;	/* the live QP number, 0 when none */
	_Atomic uint32_t state; /* enum ibv_qp_state */
	uint32_t access;	/* qp_access_flags */
	uint64_t pd;
	uint32_t rq_psn;
	uint32_t max_dest_rd_atomic;
	uint16_t lid;
	uint8_t dev_idx;
	uint8_t pad;
	uint32_t gen;
};

struct sv_mr_slot {
	_Atomic uint32_t owner;
	_Atomic uint32_t key;
	uint32_t access;
	uint32_t gen;
	uint64_t pd;
	uint64_t addr;
	uint64_t len;
};

struct sv_registry {
	struct sv_qp_slot qps[SV_QP_SLOTS];
	struct sv_mr_slot mrs[SV_MR_SLOTS];
	/* Ports taken down by softverbs_set_port, per device index. */
	_Atomic uint32_t port_down[SV_MAX_DEVICES];
};

static struct sv_registry *g_reg;
static uint32_t g_pid;

static int port_is_down(const struct sv_device *d)
{
	return d->port_down || (g_reg && atomic_load(&g_reg->port_down[d->idx]));
}

static int pid_alive(uint32_t pid)
{
	return pid != 0 && (kill((pid_t)pid, 0) == 0 || errno != ESRCH);
}

static void open_registry(void)
{
	char path[128];
	const char *given = getenv("SOFTVERBS_REGISTRY");
	if (given && *given)
		snprintf(path, sizeof(path), "%s", given);
	else
		snprintf(path, sizeof(path), "/dev/shm/softverbs-%u", (unsigned)getuid());
	int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
	if (fd < 0) {
		perror("softverbs: registry");
		return;
	}
	struct stat st;
	if (fstat(fd, &st) == 0 && (size_t)st.st_size < sizeof(struct sv_registry) &&
	    ftruncate(fd, sizeof(struct sv_registry)) != 0) {
		perror("softverbs: registry size");
		close(fd);
		return;
	}
	void *p = mmap(NULL, sizeof(struct sv_registry), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	close(fd);
	if (p == MAP_FAILED) {
		perror("softverbs: registry map");
		return;
	}
	g_reg = p;
}

static void init_once(void)
{
	g_pid = (uint32_t)getpid();
	open_registry();
	setup_devices();
}

static void init(void)
{
	pthread_once(&g_once, init_once);
}

/* Claims a free slot (or one whose owner died) starting near `hint`. */
static int claim(_Atomic uint32_t *owner0, size_t stride, uint32_t n, uint32_t hint)
{
	for (uint32_t k = 0; k < n; k++) {
		uint32_t i = 1 + (hint + k) % (n - 1);
		_Atomic uint32_t *o = (_Atomic uint32_t *)((char *)owner0 + stride * i);
		uint32_t cur = atomic_load(o);
		if (cur != 0 && pid_alive(cur))
			continue;
		if (atomic_compare_exchange_strong(o, &cur, g_pid))
			return (int)i;
	}
	return -1;
}

/* ----------------------------------------------------------- PD, MR, ctx */

struct sv_context {
	struct verbs_context vctx;
	struct sv_device *dev;
	int port_reported_down;
};

struct sv_pd {
	struct ibv_pd pd;
	uint64_t key;
	_Atomic int users;
};

struct sv_mr {
	struct ibv_mr mr;
	uint32_t slot;
	uint64_t bytes;
};

static _Atomic uint64_t g_pd_counter;
static _Atomic uint64_t g_registered_bytes;

static struct sv_context *ctx_of(struct ibv_context *c)
{
	return (struct sv_context *)((char *)c - offsetof(struct sv_context, vctx.context));
}

/* ------------------------------------------------------------- CQ and QP */

struct sv_qp;

struct sv_cqe {
	uint64_t wr_id;
	uint32_t status;
	uint32_t opcode;
	uint32_t byte_len;
	uint32_t qp_num;
	uint32_t vendor_err;
	struct sv_qp *qp;
	uint64_t seq;
};

struct sv_cq {
	struct ibv_cq_ex ex;
	struct sv_cqe *ring;
	uint32_t cap;
	uint64_t head, tail;
	struct sv_cqe cur;
	int users;
};

struct sv_wr {
	uint64_t wr_id;
	uint64_t raddr;
	uint64_t seq;
	uint32_t flags;
	uint32_t opcode; /* IBV_WR_RDMA_WRITE / IBV_WR_RDMA_READ, else unsupported */
	uint32_t rkey;
	uint32_t num_sge;
	uint32_t inline_len; /* > 0: the payload is inline_data, no SGE */
	struct ibv_sge sge[SV_MAX_SGE];
	uint8_t inline_data[SV_MAX_INLINE];
};

struct sv_qp {
	struct ibv_qp_ex ex; /* first: ibv_qp * == ibv_qp_ex * (qp_base) */
	struct sv_context *ctx;
	struct sv_pd *pd;
	struct sv_cq *scq, *rcq;
	uint32_t slot;
	uint32_t max_send_wr;
	uint32_t max_send_sge;
	uint32_t max_inline;
	/* from modify_qp */
	uint8_t port;
	uint32_t access;
	uint32_t dest_qpn;
	uint32_t sq_psn;
	uint8_t timeout, retry_cnt, max_rd_atomic;
	struct ibv_ah_attr ah;
	uint8_t path_mtu;
	/* the send queue, under g_lock: [retired, head) executed, [head, tail)
	 * waiting; slots are free again only once a later completion is polled */
	struct sv_wr *ring;
	uint64_t head, tail, retired;
	uint64_t retry_deadline_ns, next_try_ns;
	int psn_in_step;
	int err_seen; /* the error state has been seen locally (or reported) */
	int busy;
	struct sv_qp *next;
	/* posting (the caller's thread) */
	struct sv_wr *stage;
	uint32_t nstage;
	int stage_err;
};

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_work = PTHREAD_COND_INITIALIZER;
static pthread_cond_t g_idle = PTHREAD_COND_INITIALIZER;
static struct sv_qp *g_qps;
static int g_engine_started;

static struct sv_qp *qp_of(struct ibv_qp *q)
{
	return (struct sv_qp *)q;
}

static struct sv_qp *qpx_of(struct ibv_qp_ex *q)
{
	return (struct sv_qp *)q;
}

static struct sv_cq *cq_of(struct ibv_cq_ex *c)
{
	return (struct sv_cq *)c;
}

static enum ibv_qp_state qp_state(struct sv_qp *q)
{
	return (enum ibv_qp_state)atomic_load(&g_reg->qps[q->slot].state);
}

static void set_state(struct sv_qp *q, enum ibv_qp_state s)
{
	atomic_store(&g_reg->qps[q->slot].state, (uint32_t)s);
	q->ex.qp_base.state = s;
	q->err_seen = s == IBV_QPS_ERR;
}

/* Under g_lock. A full CQ is an overrun: the QP goes to error (the
 * completion is lost, as it would be on a NIC). */
static void push_cqe(struct sv_qp *q, const struct sv_wr *w, enum ibv_wc_status st,
		     uint32_t byte_len)
{
	struct sv_cq *cq = q->scq;
	if (cq->tail - cq->head >= cq->cap) {
		fprintf(stderr, "softverbs: CQ overrun (%u entries); QP %u to error\n", cq->cap,
			q->ex.qp_base.qp_num);
		set_state(q, IBV_QPS_ERR);
		return;
	}
	struct sv_cqe *e = &cq->ring[cq->tail % cq->cap];
	e->wr_id = w->wr_id;
	e->status = st;
	e->opcode = w->opcode == IBV_WR_RDMA_READ ? IBV_WC_RDMA_READ : IBV_WC_RDMA_WRITE;
	e->byte_len = byte_len;
	e->qp_num = q->ex.qp_base.qp_num;
	e->vendor_err = st == IBV_WC_SUCCESS ? 0 : 0x80 + st;
	e->qp = q;
	e->seq = w->seq;
	cq->tail++;
}

/* ------------------------------------------------------------ the engine */

enum outcome { RUN_OK, RUN_RETRY, RUN_FAIL };

static int lookup_mr(uint32_t key, uint32_t owner, uint64_t pd, uint64_t addr, uint64_t len,
		     uint32_t need)
{
	struct sv_mr_slot *m = &g_reg->mrs[key % SV_MR_SLOTS];
	if (key == 0 || atomic_load(&m->key) != key)
		return 0;
	int ok = atomic_load(&m->owner) == owner && m->pd == pd && addr >= m->addr &&
		 len <= m->len && addr - m->addr <= m->len - len && (m->access & need) == need;
	return ok && atomic_load(&m->key) == key;
}

static int gid_reaches(const struct sv_qp *q, const struct sv_device *peer, uint32_t peer_slot)
{
	const struct sv_device *me = q->ctx->dev;
	if (me->infiniband != peer->infiniband)
		return 0;
	if (peer->infiniband) {
		if (q->ah.dlid != g_reg->qps[peer_slot].lid)
			return 0;
		if (!q->ah.is_global)
			return 1;
	}
	if (!q->ah.is_global || q->ah.grh.sgid_index >= me->ngids)
		return 0;
	enum ibv_gid_type_sysfs mine = me->gid_types[q->ah.grh.sgid_index];
	for (int k = 0; k < peer->ngids; k++) {
		if (memcmp(peer->gids[k].raw, q->ah.grh.dgid.raw, 16) != 0)
			continue;
		if (peer->gid_types[k] != mine)
			continue; /* RoCE v1 and v2 packets do not meet */
		if (env_long("SOFTVERBS_ROUTED", 0) && me != peer &&
		    (mine != IBV_GID_TYPE_SYSFS_ROCE_V2 || q->ah.grh.dgid.raw[0] == 0xfe))
			return 0; /* not routable */
		return 1;
	}
	return 0;
}

static size_t sge_iov(const struct sv_wr *w, struct iovec *iov)
{
	size_t total = 0;
	for (uint32_t i = 0; i < w->num_sge; i++) {
		iov[i].iov_base = (void *)(uintptr_t)w->sge[i].addr;
		iov[i].iov_len = w->sge[i].length;
		total += w->sge[i].length;
	}
	return total;
}

/* Runs one WR against the peer: RUN_OK, RUN_RETRY (the peer cannot be
 * reached now), or RUN_FAIL with *st. Called without g_lock. */
static enum outcome run_wr(struct sv_qp *q, const struct sv_wr *w, enum ibv_wc_status *st,
			   uint32_t *byte_len, int *peer_error)
{
	int read = w->opcode == IBV_WR_RDMA_READ;
	if (w->opcode != IBV_WR_RDMA_READ && w->opcode != IBV_WR_RDMA_WRITE) {
		*st = IBV_WC_LOC_QP_OP_ERR;
		return RUN_FAIL;
	}
	uint64_t total = w->inline_len;
	if (w->inline_len && read) {
		*st = IBV_WC_LOC_QP_OP_ERR; /* a READ has nowhere inline to land */
		return RUN_FAIL;
	}
	for (uint32_t i = 0; i < w->num_sge; i++) {
		const struct ibv_sge *s = &w->sge[i];
		if (!lookup_mr(s->lkey, g_pid, q->pd->key, s->addr, s->length,
			       read ? IBV_ACCESS_LOCAL_WRITE : 0)) {
			*st = IBV_WC_LOC_PROT_ERR;
			return RUN_FAIL;
		}
		total += s->length;
	}
	if (total > SV_MAX_MSG) {
		*st = IBV_WC_LOC_LEN_ERR;
		return RUN_FAIL;
	}
	uint32_t pslot = q->dest_qpn % SV_QP_SLOTS;
	struct sv_qp_slot *p = &g_reg->qps[pslot];
	if (q->dest_qpn == 0 || atomic_load(&p->qpn) != q->dest_qpn)
		return RUN_RETRY; /* no such QP: nobody answers */
	uint32_t ps = atomic_load(&p->state);
	uint32_t ppid = atomic_load(&p->owner);
	if ((ps != IBV_QPS_RTR && ps != IBV_QPS_RTS && ps != IBV_QPS_SQD) || !pid_alive(ppid))
		return RUN_RETRY;
	if (p->dev_idx >= g_ndevs || !gid_reaches(q, &g_devs[p->dev_idx], pslot))
		return RUN_RETRY;
	if (port_is_down(q->ctx->dev) || port_is_down(&g_devs[p->dev_idx]))
		return RUN_RETRY; /* no link: nothing gets through */
	if (!q->psn_in_step) {
		/* The first packet carries sq_psn; a responder expecting another
		 * PSN drops it (a sequence NAK, then retries). */
		if ((q->sq_psn & 0xffffff) != (p->rq_psn & 0xffffff))
			return RUN_RETRY;
		q->psn_in_step = 1;
	}
	if (!(p->access & (read ? IBV_ACCESS_REMOTE_READ : IBV_ACCESS_REMOTE_WRITE))) {
		*st = IBV_WC_REM_ACCESS_ERR;
		*peer_error = 1;
		return RUN_FAIL;
	}
	if (read && q->max_rd_atomic > p->max_dest_rd_atomic) {
		/* More READs in flight than the responder has resources for. */
		*st = IBV_WC_REM_INV_REQ_ERR;
		*peer_error = 1;
		return RUN_FAIL;
	}
	uint64_t pd = p->pd;
	if (atomic_load(&p->qpn) != q->dest_qpn) /* changed under us */
		return RUN_RETRY;
	if (!lookup_mr(w->rkey, ppid, pd, w->raddr, total,
		       read ? IBV_ACCESS_REMOTE_READ : IBV_ACCESS_REMOTE_WRITE)) {
		*st = IBV_WC_REM_ACCESS_ERR;
		*peer_error = 1;
		return RUN_FAIL;
	}
	struct iovec liov[SV_MAX_SGE];
	uint32_t nl = w->num_sge;
	if (w->inline_len) {
		liov[0].iov_base = (void *)w->inline_data;
		liov[0].iov_len = w->inline_len;
		nl = 1;
	} else {
		sge_iov(w, liov);
	}
	uint64_t done = 0;
	while (done < total) {
		if (ppid == g_pid) {
			/* Our own memory: copy directly. */
			uint64_t off = 0;
			for (uint32_t i = 0; i < nl; i++) {
				char *l = liov[i].iov_base;
				char *r = (char *)(uintptr_t)(w->raddr + off);
				if (read)
					memmove(l, r, liov[i].iov_len);
				else
					memmove(r, l, liov[i].iov_len);
				off += liov[i].iov_len;
			}
			done = total;
			break;
		}
		/* Skip what is done: rebuild the local iovec from `done`. */
		struct iovec l2[SV_MAX_SGE];
		uint32_t n = 0;
		uint64_t skip = done;
		for (uint32_t i = 0; i < nl; i++) {
			if (skip >= liov[i].iov_len) {
				skip -= liov[i].iov_len;
				continue;
			}
			l2[n].iov_base = (char *)liov[i].iov_base + skip;
			l2[n].iov_len = liov[i].iov_len - skip;
			skip = 0;
			n++;
		}
		struct iovec r = {(void *)(uintptr_t)(w->raddr + done), total - done};
		ssize_t got = read ? process_vm_readv((pid_t)ppid, l2, n, &r, 1, 0)
				   : process_vm_writev((pid_t)ppid, l2, n, &r, 1, 0);
		if (got <= 0) {
			if (got < 0 && errno == ESRCH)
				return RUN_RETRY; /* the peer is gone */
			if (got < 0 && errno == EPERM) {
				static int said;
				if (!said++)
					fprintf(stderr, "softverbs: process_vm_%sv refused (EPERM): "
							"ptrace restrictions between these processes\n",
						read ? "read" : "write");
			}
			*st = IBV_WC_REM_OP_ERR;
			return RUN_FAIL;
		}
		done += (uint64_t)got;
	}
	*byte_len = (uint32_t)total;
	*st = IBV_WC_SUCCESS;
	atomic_fetch_add(&g_dev_wrs[q->ctx->dev->idx], 1);
	if (w->inline_len)
		atomic_fetch_add(&g_inline_wrs, 1);
	return RUN_OK;
}

static uint64_t retry_window_ns(const struct sv_qp *q)
{
	/* 4.096 us x 2^timeout per try, retry_cnt + 1 tries; 0 is "forever". */
	uint64_t per = q->timeout ? 4096ull << q->timeout : 0;
	uint64_t win = per ? per * (q->retry_cnt + 1u) : 30000000000ull;
	long cap_ms = env_long("SOFTVERBS_RETRY_MS", 0);
	if (cap_ms > 0 && win > (uint64_t)cap_ms * 1000000ull)
		win = (uint64_t)cap_ms * 1000000ull;
	return win;
}

/* Under g_lock: flushes every waiting WR of an errored QP. */
static void flush_qp(struct sv_qp *q)
{
	while (q->head < q->tail) {
		struct sv_wr *w = &q->ring[q->head % q->max_send_wr];
		push_cqe(q, w, IBV_WC_WR_FLUSH_ERR, 0);
		q->head++;
	}
}

/* Under g_lock: runs up to `budget` WRs of `q`; returns the time it wants
 * to be looked at again (0: when there is new work). */
static uint64_t step_qp(struct sv_qp *q, int budget)
{
	while (budget-- > 0 && q->head < q->tail) {
		if (qp_state(q) == IBV_QPS_ERR) {
			flush_qp(q);
			break;
		}
		uint64_t t = now_ns();
		if (q->next_try_ns > t)
			return q->next_try_ns;
		struct sv_wr w = q->ring[q->head % q->max_send_wr];
		q->busy = 1;
		pthread_mutex_unlock(&g_lock);
		enum ibv_wc_status st = IBV_WC_SUCCESS;
		uint32_t len = 0;
		int peer_error = 0;
		enum outcome o = run_wr(q, &w, &st, &len, &peer_error);
		pthread_mutex_lock(&g_lock);
		q->busy = 0;
		pthread_cond_broadcast(&g_idle);
		if (o == RUN_RETRY) {
			t = now_ns();
			if (q->retry_deadline_ns == 0)
				q->retry_deadline_ns = t + retry_window_ns(q);
			if (t < q->retry_deadline_ns) {
				q->next_try_ns = t + 1000000; /* again in 1 ms */
				return q->next_try_ns;
			}
			o = RUN_FAIL;
			st = IBV_WC_RETRY_EXC_ERR;
		}
		q->retry_deadline_ns = 0;
		q->next_try_ns = 0;
		if (o == RUN_FAIL) {
			if (peer_error) {
				uint32_t pslot = q->dest_qpn % SV_QP_SLOTS;
				struct sv_qp_slot *p = &g_reg->qps[pslot];
				if (atomic_load(&p->qpn) == q->dest_qpn)
					atomic_store(&p->state, IBV_QPS_ERR);
			}
			set_state(q, IBV_QPS_ERR);
			push_cqe(q, &w, st, 0);
			q->head++;
			flush_qp(q);
			break;
		}
		if (w.flags & IBV_SEND_SIGNALED)
			push_cqe(q, &w, IBV_WC_SUCCESS, len);
		q->head++;
	}
	return 0;
}

static void *engine(void *arg)
{
	(void)arg;
	pthread_mutex_lock(&g_lock);
	for (;;) {
		uint64_t wake = 0;
		int worked = 0;
		for (struct sv_qp *q = g_qps; q; q = q->next) {
			if (q->head >= q->tail)
				continue;
			uint64_t before = q->head;
			uint64_t w = step_qp(q, 64);
			if (q->head != before)
				worked = 1;
			if (w && (!wake || w < wake))
				wake = w;
			/* The list may have changed while the lock was down;
			 * a removed QP is never stepped while busy (destroy
			 * waits), and `next` stays valid until it is freed,
			 * which happens only after unlinking under this lock.
			 * Restart the walk to be safe. */
			if (worked)
				break;
		}
		if (worked)
			continue;
		int pending = 0;
		for (struct sv_qp *q = g_qps; q; q = q->next)
			if (q->head < q->tail)
				pending = 1;
		if (pending && !wake)
			continue;
		if (wake) {
			struct timespec ts;
			clock_gettime(CLOCK_MONOTONIC, &ts);
			uint64_t t = now_ns();
			uint64_t d = wake > t ? wake - t : 0;
			ts.tv_sec += (time_t)(d / 1000000000ull);
			ts.tv_nsec += (long)(d % 1000000000ull);
			if (ts.tv_nsec >= 1000000000) {
				ts.tv_sec++;
				ts.tv_nsec -= 1000000000;
			}
			pthread_cond_timedwait(&g_work, &g_lock, &ts);
		} else {
			pthread_cond_wait(&g_work, &g_lock);
		}
	}
	return NULL;
}

static void start_engine(void)
{
	/* Under g_lock. */
	if (g_engine_started)
		return;
	pthread_condattr_t ca;
	pthread_condattr_init(&ca);
	pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
	pthread_cond_destroy(&g_work);
	pthread_cond_init(&g_work, &ca);
	pthread_t t;
	pthread_attr_t a;
	pthread_attr_init(&a);
	pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
	/* The engine must not take signals meant for the application. */
	sigset_t all, old;
	sigfillset(&all);
	pthread_sigmask(SIG_BLOCK, &all, &old);
	if (pthread_create(&t, &a, engine, NULL) == 0)
		g_engine_started = 1;
	pthread_sigmask(SIG_SETMASK, &old, NULL);
	pthread_attr_destroy(&a);
}

/* ----------------------------------------------------- CQ polling hooks */

/* Under g_lock: pops the oldest completion into cq->cur/ex. */
static int pop_cqe(struct sv_cq *cq)
{
	if (cq->head == cq->tail)
		return ENOENT;
	cq->cur = cq->ring[cq->head % cq->cap];
	cq->head++;
	if (cq->cur.qp)
		cq->cur.qp->retired = cq->cur.seq + 1;
	cq->ex.status = cq->cur.status;
	cq->ex.wr_id = cq->cur.wr_id;
	return 0;
}

static int sv_start_poll(struct ibv_cq_ex *c, struct ibv_poll_cq_attr *attr)
{
	(void)attr;
	pthread_mutex_lock(&g_lock);
	int r = pop_cqe(cq_of(c));
	pthread_mutex_unlock(&g_lock);
	return r;
}

static int sv_next_poll(struct ibv_cq_ex *c)
{
	return sv_start_poll(c, NULL);
}

static void sv_end_poll(struct ibv_cq_ex *c)
{
	(void)c;
}

static enum ibv_wc_opcode sv_read_opcode(struct ibv_cq_ex *c)
{
	return (enum ibv_wc_opcode)cq_of(c)->cur.opcode;
}

static uint32_t sv_read_vendor_err(struct ibv_cq_ex *c)
{
	return cq_of(c)->cur.vendor_err;
}

static uint32_t sv_read_byte_len(struct ibv_cq_ex *c)
{
	return cq_of(c)->cur.byte_len;
}

static __be32 sv_read_imm_data(struct ibv_cq_ex *c)
{
	(void)c;
	return 0;
}

static uint32_t sv_read_qp_num(struct ibv_cq_ex *c)
{
	return cq_of(c)->cur.qp_num;
}

static unsigned int sv_read_wc_flags(struct ibv_cq_ex *c)
{
	(void)c;
	return 0;
}

static uint64_t sv_read_completion_ts(struct ibv_cq_ex *c)
{
	(void)c;
	return now_ns();
}

static int sv_poll_cq(struct ibv_cq *c, int n, struct ibv_wc *wc)
{
	struct sv_cq *cq = (struct sv_cq *)c;
	int got = 0;
	pthread_mutex_lock(&g_lock);
	while (got < n && pop_cqe(cq) == 0) {
		memset(&wc[got], 0, sizeof(wc[got]));
		wc[got].wr_id = cq->cur.wr_id;
		wc[got].status = (enum ibv_wc_status)cq->cur.status;
		wc[got].opcode = (enum ibv_wc_opcode)cq->cur.opcode;
		wc[got].byte_len = cq->cur.byte_len;
		wc[got].qp_num = cq->cur.qp_num;
		wc[got].vendor_err = cq->cur.vendor_err;
		got++;
	}
	pthread_mutex_unlock(&g_lock);
	return got;
}

static int sv_req_notify_cq(struct ibv_cq *c, int solicited)
{
	(void)c;
	(void)solicited;
	return EOPNOTSUPP;
}

static struct ibv_cq_ex *sv_create_cq_ex(struct ibv_context *context,
					 struct ibv_cq_init_attr_ex *attr)
{
	if (fail_at("create_cq")) {
		errno = ENOMEM;
		return NULL;
	}
	if (!attr || attr->cqe == 0 || attr->cqe > SV_MAX_CQE || attr->channel) {
		errno = EINVAL;
		return NULL;
	}
	struct sv_cq *cq = calloc(1, sizeof(*cq));
	if (!cq)
		return NULL;
	cq->cap = attr->cqe;
	cq->ring = calloc(cq->cap, sizeof(struct sv_cqe));
	if (!cq->ring) {
		free(cq);
		errno = ENOMEM;
		return NULL;
	}
	cq->ex.context = context;
	cq->ex.cq_context = attr->cq_context;
	cq->ex.cqe = (int)cq->cap;
	pthread_mutex_init(&cq->ex.mutex, NULL);
	pthread_cond_init(&cq->ex.cond, NULL);
	cq->ex.start_poll = sv_start_poll;
	cq->ex.next_poll = sv_next_poll;
	cq->ex.end_poll = sv_end_poll;
	cq->ex.read_opcode = sv_read_opcode;
	cq->ex.read_vendor_err = sv_read_vendor_err;
	cq->ex.read_byte_len = sv_read_byte_len;
	cq->ex.read_imm_data = sv_read_imm_data;
	cq->ex.read_qp_num = sv_read_qp_num;
	cq->ex.read_wc_flags = sv_read_wc_flags;
	cq->ex.read_completion_ts = sv_read_completion_ts;
	atomic_fetch_add(&g_live_cqs, 1);
	return &cq->ex;
}

SV_EXPORT struct ibv_cq *ibv_create_cq(struct ibv_context *context, int cqe, void *cq_context,
				       struct ibv_comp_channel *channel, int comp_vector)
{
	struct ibv_cq_init_attr_ex a;
	memset(&a, 0, sizeof(a));
	a.cqe = cqe > 0 ? (uint32_t)cqe : 0;
	a.cq_context = cq_context;
	a.channel = channel;
	a.comp_vector = (uint32_t)comp_vector;
	struct ibv_cq_ex *c = sv_create_cq_ex(context, &a);
	return c ? (struct ibv_cq *)c : NULL;
}

SV_EXPORT int ibv_destroy_cq(struct ibv_cq *c)
{
	struct sv_cq *cq = (struct sv_cq *)c;
	if (fail_at("destroy_cq"))
		return EBUSY;
	pthread_mutex_lock(&g_lock);
	int users = cq->users;
	pthread_mutex_unlock(&g_lock);
	if (users)
		return EBUSY;
	free(cq->ring);
	free(cq);
	atomic_fetch_sub(&g_live_cqs, 1);
	return 0;
}

SV_EXPORT int ibv_resize_cq(struct ibv_cq *cq, int cqe)
{
	(void)cq;
	(void)cqe;
	return EOPNOTSUPP;
}

/* --------------------------------------------------------- posting hooks */

static struct sv_wr *new_wr(struct sv_qp *q, uint32_t opcode, uint32_t rkey, uint64_t raddr)
{
	if (q->nstage >= q->max_send_wr) {
		q->stage_err = ENOMEM;
		return NULL;
	}
	struct sv_wr *w = &q->stage[q->nstage++];
	w->wr_id = q->ex.wr_id;
	w->flags = q->ex.wr_flags;
	w->opcode = opcode;
	w->rkey = rkey;
	w->raddr = raddr;
	w->num_sge = 0;
	w->inline_len = 0;
	return w;
}

static struct sv_wr *last_wr(struct sv_qp *q)
{
	if (q->nstage == 0) {
		q->stage_err = EINVAL;
		return NULL;
	}
	return &q->stage[q->nstage - 1];
}

static void sv_wr_start(struct ibv_qp_ex *x)
{
	struct sv_qp *q = qpx_of(x);
	q->nstage = 0;
	q->stage_err = 0;
}

static void sv_wr_rdma_write(struct ibv_qp_ex *x, uint32_t rkey, uint64_t raddr)
{
	new_wr(qpx_of(x), IBV_WR_RDMA_WRITE, rkey, raddr);
}

static void sv_wr_rdma_read(struct ibv_qp_ex *x, uint32_t rkey, uint64_t raddr)
{
	new_wr(qpx_of(x), IBV_WR_RDMA_READ, rkey, raddr);
}

static void sv_wr_unsupported(struct sv_qp *q)
{
	q->stage_err = EOPNOTSUPP;
}

static void sv_wr_send(struct ibv_qp_ex *x)
{
	sv_wr_unsupported(qpx_of(x));
}

static void sv_wr_send_imm(struct ibv_qp_ex *x, __be32 imm)
{
	(void)imm;
	sv_wr_unsupported(qpx_of(x));
}

static void sv_wr_rdma_write_imm(struct ibv_qp_ex *x, uint32_t rkey, uint64_t raddr, __be32 imm)
{
	(void)rkey;
	(void)raddr;
	(void)imm;
	sv_wr_unsupported(qpx_of(x));
}

static void sv_wr_atomic_cmp_swp(struct ibv_qp_ex *x, uint32_t rkey, uint64_t raddr,
				 uint64_t cmp, uint64_t swap)
{
	(void)rkey;
	(void)raddr;
	(void)cmp;
	(void)swap;
	sv_wr_unsupported(qpx_of(x));
}

static void sv_wr_atomic_fetch_add(struct ibv_qp_ex *x, uint32_t rkey, uint64_t raddr,
				   uint64_t add)
{
	(void)rkey;
	(void)raddr;
	(void)add;
	sv_wr_unsupported(qpx_of(x));
}

static void sv_wr_set_inline_data(struct ibv_qp_ex *x, void *addr, size_t len)
{
	struct sv_qp *q = qpx_of(x);
	struct sv_wr *w = last_wr(q);
	if (!w)
		return;
	if (len == 0 || len > q->max_inline) {
		q->stage_err = EINVAL;
		return;
	}
	memcpy(w->inline_data, addr, len);
	w->inline_len = (uint32_t)len;
	w->num_sge = 0;
}

static void sv_wr_set_inline_data_list(struct ibv_qp_ex *x, size_t n,
				       const struct ibv_data_buf *l)
{
	struct sv_qp *q = qpx_of(x);
	struct sv_wr *w = last_wr(q);
	if (!w)
		return;
	size_t total = 0;
	for (size_t i = 0; i < n; i++) {
		if (total + l[i].length > q->max_inline) {
			q->stage_err = EINVAL;
			return;
		}
		memcpy(w->inline_data + total, l[i].addr, l[i].length);
		total += l[i].length;
	}
	if (total == 0) {
		q->stage_err = EINVAL;
		return;
	}
	w->inline_len = (uint32_t)total;
	w->num_sge = 0;
}

static void sv_wr_set_sge(struct ibv_qp_ex *x, uint32_t lkey, uint64_t addr, uint32_t length)
{
	struct sv_wr *w = last_wr(qpx_of(x));
	if (!w)
		return;
	w->num_sge = 1;
	w->sge[0].lkey = lkey;
	w->sge[0].addr = addr;
	w->sge[0].length = length;
}

static void sv_wr_set_sge_list(struct ibv_qp_ex *x, size_t n, const struct ibv_sge *l)
{
	struct sv_qp *q = qpx_of(x);
	struct sv_wr *w = last_wr(q);
	if (!w)
		return;
	if (n > q->max_send_sge || n > SV_MAX_SGE) {
		q->stage_err = EINVAL;
		return;
	}
	w->num_sge = (uint32_t)n;
	memcpy(w->sge, l, n * sizeof(*l));
}

static int sv_wr_complete(struct ibv_qp_ex *x)
{
	struct sv_qp *q = qpx_of(x);
	int err = q->stage_err;
	if (!err && fail_at("post"))
		err = ENOMEM;
	enum ibv_qp_state s = qp_state(q);
	if (!err && s != IBV_QPS_RTS && s != IBV_QPS_ERR && s != IBV_QPS_SQD)
		err = EINVAL;
	for (uint32_t i = 0; !err && i < q->nstage; i++)
		if (q->stage[i].num_sge == 0 && q->stage[i].inline_len == 0)
			err = EINVAL; /* a WR without its data */
	if (err) {
		q->nstage = 0;
		q->stage_err = 0;
		return err;
	}
	pthread_mutex_lock(&g_lock);
	if ((q->tail - q->retired) + q->nstage > q->max_send_wr) {
		pthread_mutex_unlock(&g_lock);
		q->nstage = 0;
		return ENOMEM; /* the send queue is full */
	}
	for (uint32_t i = 0; i < q->nstage; i++) {
		q->stage[i].seq = q->tail;
		q->ring[q->tail % q->max_send_wr] = q->stage[i];
		q->tail++;
	}
	q->nstage = 0;
	pthread_cond_signal(&g_work);
	pthread_mutex_unlock(&g_lock);
	return 0;
}

static void sv_wr_abort(struct ibv_qp_ex *x)
{
	struct sv_qp *q = qpx_of(x);
	q->nstage = 0;
	q->stage_err = 0;
}

static int sv_post_send(struct ibv_qp *qp, struct ibv_send_wr *wr, struct ibv_send_wr **bad)
{
	struct sv_qp *q = qp_of(qp);
	sv_wr_start(&q->ex);
	for (struct ibv_send_wr *w = wr; w; w = w->next) {
		q->ex.wr_id = w->wr_id;
		q->ex.wr_flags = w->send_flags;
		if (w->opcode == IBV_WR_RDMA_WRITE)
			sv_wr_rdma_write(&q->ex, w->wr.rdma.rkey, w->wr.rdma.remote_addr);
		else if (w->opcode == IBV_WR_RDMA_READ)
			sv_wr_rdma_read(&q->ex, w->wr.rdma.rkey, w->wr.rdma.remote_addr);
		else
			sv_wr_unsupported(q);
		if (w->num_sge > 0)
			sv_wr_set_sge_list(&q->ex, (size_t)w->num_sge, w->sg_list);
	}
	int r = sv_wr_complete(&q->ex);
	if (r && bad)
		*bad = wr;
	return r;
}

static int sv_post_recv(struct ibv_qp *qp, struct ibv_recv_wr *wr, struct ibv_recv_wr **bad)
{
	(void)qp;
	if (bad)
		*bad = wr;
	return EOPNOTSUPP;
}

/* ------------------------------------------------------------ QP objects */

static struct ibv_qp *sv_create_qp_ex(struct ibv_context *context,
				      struct ibv_qp_init_attr_ex *a)
{
	init();
	if (!g_reg) {
		errno = ENODEV;
		return NULL;
	}
	if (fail_at("create_qp")) {
		errno = ENOMEM;
		return NULL;
	}
	if (!(a->comp_mask & IBV_QP_INIT_ATTR_PD) || !a->pd || a->qp_type != IBV_QPT_RC ||
	    !a->send_cq || !a->recv_cq || a->srq || a->cap.max_send_wr == 0 ||
	    a->cap.max_send_wr > SV_MAX_QP_WR || a->cap.max_send_sge > SV_MAX_SGE ||
	    a->cap.max_inline_data > SV_MAX_INLINE) {
		errno = EINVAL;
		return NULL;
	}
	struct sv_qp *q = calloc(1, sizeof(*q));
	if (!q)
		return NULL;
	q->max_send_wr = a->cap.max_send_wr;
	q->max_send_sge = a->cap.max_send_sge ? a->cap.max_send_sge : 1;
	q->max_inline = a->cap.max_inline_data;
	q->ring = calloc(q->max_send_wr, sizeof(struct sv_wr));
	q->stage = calloc(q->max_send_wr, sizeof(struct sv_wr));
	int slot = claim(&g_reg->qps[0].owner, sizeof(struct sv_qp_slot), SV_QP_SLOTS,
			 g_pid * 2654435761u);
	if (!q->ring || !q->stage || slot < 0) {
		free(q->ring);
		free(q->stage);
		free(q);
		errno = ENOMEM;
		return NULL;
	}
	struct sv_qp_slot *s = &g_reg->qps[slot];
	s->gen = (s->gen + 1) & 0xff;
	if (s->gen == 0)
		s->gen = 1;
	uint32_t qpn = (uint32_t)slot | (s->gen << 16);
	q->slot = (uint32_t)slot;
	q->ctx = ctx_of(context);
	q->pd = (struct sv_pd *)a->pd;
	q->scq = (struct sv_cq *)a->send_cq;
	q->rcq = (struct sv_cq *)a->recv_cq;
	s->access = 0;
	s->pd = q->pd->key;
	s->rq_psn = 0;
	s->max_dest_rd_atomic = 0;
	s->lid = q->ctx->dev->lid;
	s->dev_idx = (uint8_t)q->ctx->dev->idx;
	atomic_store(&s->state, IBV_QPS_RESET);
	atomic_store(&s->qpn, qpn);

	struct ibv_qp *b = &q->ex.qp_base;
	b->context = context;
	b->qp_context = a->qp_context;
	b->pd = a->pd;
	b->send_cq = a->send_cq;
	b->recv_cq = a->recv_cq;
	b->qp_num = qpn;
	b->state = IBV_QPS_RESET;
	b->qp_type = IBV_QPT_RC;
	pthread_mutex_init(&b->mutex, NULL);
	pthread_cond_init(&b->cond, NULL);
	q->ex.wr_rdma_write = sv_wr_rdma_write;
	q->ex.wr_rdma_read = sv_wr_rdma_read;
	q->ex.wr_rdma_write_imm = sv_wr_rdma_write_imm;
	q->ex.wr_send = sv_wr_send;
	q->ex.wr_send_imm = sv_wr_send_imm;
	q->ex.wr_atomic_cmp_swp = sv_wr_atomic_cmp_swp;
	q->ex.wr_atomic_fetch_add = sv_wr_atomic_fetch_add;
	q->ex.wr_set_inline_data = sv_wr_set_inline_data;
	q->ex.wr_set_inline_data_list = sv_wr_set_inline_data_list;
	q->ex.wr_set_sge = sv_wr_set_sge;
	q->ex.wr_set_sge_list = sv_wr_set_sge_list;
	q->ex.wr_start = sv_wr_start;
	q->ex.wr_complete = sv_wr_complete;
	q->ex.wr_abort = sv_wr_abort;
	atomic_fetch_add(&q->pd->users, 1);
	pthread_mutex_lock(&g_lock);
	q->scq->users++;
	if (q->rcq != q->scq)
		q->rcq->users++;
	q->next = g_qps;
	g_qps = q;
	start_engine();
	pthread_mutex_unlock(&g_lock);
	return b;
}

SV_EXPORT struct ibv_qp *ibv_create_qp(struct ibv_pd *pd, struct ibv_qp_init_attr *attr)
{
	struct ibv_qp_init_attr_ex a;
	memset(&a, 0, sizeof(a));
	memcpy(&a, attr, sizeof(*attr));
	a.comp_mask = IBV_QP_INIT_ATTR_PD;
	a.pd = pd;
	struct ibv_qp *q = sv_create_qp_ex(pd->context, &a);
	if (q)
		attr->cap = a.cap;
	return q;
}

SV_EXPORT struct ibv_qp_ex *ibv_qp_to_qp_ex(struct ibv_qp *qp)
{
	return &qp_of(qp)->ex;
}

SV_EXPORT int ibv_destroy_qp(struct ibv_qp *qp)
{
	struct sv_qp *q = qp_of(qp);
	if (fail_at("destroy_qp"))
		return EBUSY;
	pthread_mutex_lock(&g_lock);
	while (q->busy)
		pthread_cond_wait(&g_idle, &g_lock);
	struct sv_qp **pp = &g_qps;
	while (*pp && *pp != q)
		pp = &(*pp)->next;
	if (*pp)
		*pp = q->next;
	/* Its completions leave the CQ with it (as mlx5 cleans a CQ). */
	struct sv_cq *cq = q->scq;
	uint64_t w = cq->head;
	for (uint64_t r = cq->head; r < cq->tail; r++) {
		struct sv_cqe e = cq->ring[r % cq->cap];
		if (e.qp != q)
			cq->ring[w++ % cq->cap] = e;
	}
	cq->tail = w;
	q->scq->users--;
	if (q->rcq != q->scq)
		q->rcq->users--;
	pthread_mutex_unlock(&g_lock);
	struct sv_qp_slot *s = &g_reg->qps[q->slot];
	atomic_store(&s->qpn, 0);
	atomic_store(&s->state, IBV_QPS_RESET);
	atomic_store(&s->owner, 0);
	atomic_fetch_sub(&q->pd->users, 1);
	free(q->ring);
	free(q->stage);
	free(q);
	return 0;
}

/* rdma-core's RC transitions: required and optional attribute masks. */
static int check_mask(int mask, int required, int optional)
{
	if ((mask & required) != required)
		return 0;
	return (mask & ~(required | optional)) == 0;
}

SV_EXPORT int ibv_modify_qp(struct ibv_qp *qp, struct ibv_qp_attr *attr, int mask)
{
	struct sv_qp *q = qp_of(qp);
	struct sv_qp_slot *s = &g_reg->qps[q->slot];
	struct sv_device *dev = q->ctx->dev;
	enum ibv_qp_state cur = qp_state(q);
	if (mask & IBV_QP_CUR_STATE && attr->cur_qp_state != cur)
		return EINVAL;
	if (!(mask & IBV_QP_STATE))
		return EINVAL; /* attribute-only changes are not modelled */
	enum ibv_qp_state to = attr->qp_state;
	if (to == IBV_QPS_RESET || to == IBV_QPS_ERR) {
		pthread_mutex_lock(&g_lock);
		while (q->busy)
			pthread_cond_wait(&g_idle, &g_lock);
		set_state(q, to);
		if (to == IBV_QPS_ERR) {
			flush_qp(q);
		} else {
			q->head = q->tail = q->retired = 0;
			q->psn_in_step = 0;
		}
		pthread_mutex_unlock(&g_lock);
		return 0;
	}
	if (cur == IBV_QPS_RESET && to == IBV_QPS_INIT) {
		if (fail_at("init"))
			return EINVAL;
		if (!check_mask(mask, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS,
				0))
			return EINVAL;
		if (attr->port_num != 1 || attr->pkey_index != 0)
			return EINVAL;
		q->port = attr->port_num;
		q->access = attr->qp_access_flags;
		s->access = q->access;
		set_state(q, IBV_QPS_INIT);
		return 0;
	}
	if (cur == IBV_QPS_INIT && to == IBV_QPS_RTR) {
		if (fail_at("rtr"))
			return EINVAL;
		if (!check_mask(mask,
				IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
					IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC |
					IBV_QP_MIN_RNR_TIMER,
				IBV_QP_ALT_PATH | IBV_QP_ACCESS_FLAGS | IBV_QP_PKEY_INDEX))
			return EINVAL;
		if (attr->path_mtu < IBV_MTU_256 || attr->path_mtu > IBV_MTU_4096)
			return EINVAL;
		if (attr->ah_attr.port_num != 1)
			return EINVAL;
		/* RoCE needs a GRH; its source GID must exist. */
		if (!dev->infiniband && !attr->ah_attr.is_global)
			return EINVAL;
		if (attr->ah_attr.is_global && attr->ah_attr.grh.sgid_index >= dev->ngids)
			return EINVAL;
		if (attr->max_dest_rd_atomic > env_long("SOFTVERBS_MAX_QP_RD_ATOM", 16))
			return EINVAL;
		if (mask & IBV_QP_ACCESS_FLAGS) {
			q->access = attr->qp_access_flags;
			s->access = q->access;
		}
		q->ah = attr->ah_attr;
		q->path_mtu = (uint8_t)attr->path_mtu;
		q->dest_qpn = attr->dest_qp_num & 0xffffff;
		s->rq_psn = attr->rq_psn & 0xffffff;
		s->max_dest_rd_atomic = attr->max_dest_rd_atomic;
		set_state(q, IBV_QPS_RTR);
		return 0;
	}
	if (cur == IBV_QPS_RTR && to == IBV_QPS_RTS) {
		if (fail_at("rts"))
			return EINVAL;
		if (!check_mask(mask,
				IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
					IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC,
				IBV_QP_CUR_STATE | IBV_QP_ACCESS_FLAGS | IBV_QP_MIN_RNR_TIMER |
					IBV_QP_ALT_PATH | IBV_QP_PATH_MIG_STATE))
			return EINVAL;
		if (attr->max_rd_atomic > env_long("SOFTVERBS_MAX_QP_RD_ATOM", 16) ||
		    attr->retry_cnt > 7 || attr->rnr_retry > 7 || attr->timeout > 31)
			return EINVAL;
		q->sq_psn = attr->sq_psn & 0xffffff;
		q->timeout = attr->timeout;
		q->retry_cnt = attr->retry_cnt;
		q->max_rd_atomic = attr->max_rd_atomic;
		set_state(q, IBV_QPS_RTS);
		return 0;
	}
	if (cur == to && (cur == IBV_QPS_INIT || cur == IBV_QPS_RTS)) {
		if (!check_mask(mask, IBV_QP_STATE,
				IBV_QP_CUR_STATE | IBV_QP_ACCESS_FLAGS | IBV_QP_PKEY_INDEX |
					IBV_QP_PORT | IBV_QP_MIN_RNR_TIMER))
			return EINVAL;
		if (mask & IBV_QP_ACCESS_FLAGS) {
			q->access = attr->qp_access_flags;
			s->access = q->access;
		}
		return 0;
	}
	return EINVAL;
}

SV_EXPORT int ibv_query_qp(struct ibv_qp *qp, struct ibv_qp_attr *attr, int mask,
			   struct ibv_qp_init_attr *init_attr)
{
	(void)mask;
	struct sv_qp *q = qp_of(qp);
	memset(attr, 0, sizeof(*attr));
	attr->qp_state = qp_state(q);
	attr->cur_qp_state = attr->qp_state;
	attr->qp_access_flags = q->access;
	attr->dest_qp_num = q->dest_qpn;
	attr->sq_psn = q->sq_psn;
	attr->rq_psn = g_reg->qps[q->slot].rq_psn;
	attr->port_num = q->port;
	attr->timeout = q->timeout;
	attr->retry_cnt = q->retry_cnt;
	attr->max_rd_atomic = q->max_rd_atomic;
	attr->max_dest_rd_atomic = (uint8_t)g_reg->qps[q->slot].max_dest_rd_atomic;
	attr->ah_attr = q->ah;
	attr->path_mtu = (enum ibv_mtu)q->path_mtu;
	attr->cap.max_send_wr = q->max_send_wr;
	attr->cap.max_send_sge = q->max_send_sge;
	if (init_attr) {
		memset(init_attr, 0, sizeof(*init_attr));
		init_attr->send_cq = qp->send_cq;
		init_attr->recv_cq = qp->recv_cq;
		init_attr->qp_type = IBV_QPT_RC;
		init_attr->cap = attr->cap;
	}
	return 0;
}

/* ------------------------------------------------------- device, context */

static int query_device(struct ibv_context *c, struct ibv_device_attr *a)
{
	struct sv_device *d = ctx_of(c)->dev;
	memset(a, 0, sizeof(*a));
	snprintf(a->fw_ver, sizeof(a->fw_ver), "softverbs 1");
	a->node_guid = htobe64(d->guid);
	a->sys_image_guid = htobe64(d->guid);
	a->max_mr_size = ~0ull;
	a->page_size_cap = 0xfffff000;
	a->vendor_id = 0x02c9;
	a->vendor_part_id = 0x5157;
	a->max_qp = (int)SV_QP_SLOTS - 1;
	a->max_qp_wr = SV_MAX_QP_WR;
	a->device_cap_flags = IBV_DEVICE_RC_RNR_NAK_GEN | IBV_DEVICE_PORT_ACTIVE_EVENT;
	a->max_sge = SV_MAX_SGE;
	a->max_sge_rd = SV_MAX_SGE;
	a->max_cq = 65536;
	a->max_cqe = SV_MAX_CQE;
	a->max_mr = (int)SV_MR_SLOTS - 1;
	a->max_pd = 1 << 20;
	int rd = (int)env_long("SOFTVERBS_MAX_QP_RD_ATOM", 16);
	a->max_qp_rd_atom = rd;
	a->max_qp_init_rd_atom = rd;
	a->max_res_rd_atom = rd * 1024;
	a->atomic_cap = IBV_ATOMIC_NONE;
	a->max_pkeys = 1;
	a->phys_port_cnt = 1;
	return 0;
}

SV_EXPORT int ibv_query_device(struct ibv_context *c, struct ibv_device_attr *a)
{
	return query_device(c, a);
}

static int sv_query_device_ex(struct ibv_context *c, const struct ibv_query_device_ex_input *in,
			      struct ibv_device_attr_ex *a, size_t size)
{
	(void)in;
	if (size < sizeof(struct ibv_device_attr))
		return EINVAL;
	memset(a, 0, size < sizeof(*a) ? size : sizeof(*a));
	return query_device(c, &a->orig_attr);
}

static int fill_port(struct ibv_context *c, uint8_t port, struct ibv_port_attr *a)
{
	struct sv_device *d = ctx_of(c)->dev;
	if (port != 1)
		return EINVAL;
	memset(a, 0, sizeof(*a));
	a->state = port_is_down(d) ? IBV_PORT_DOWN : IBV_PORT_ACTIVE;
	a->max_mtu = IBV_MTU_4096;
	a->active_mtu = IBV_MTU_4096;
	a->gid_tbl_len = d->ngids;
	a->max_msg_sz = SV_MAX_MSG;
	a->pkey_tbl_len = 1;
	a->lid = d->lid;
	a->sm_lid = d->infiniband ? 1 : 0;
	a->max_vl_num = 4;
	a->active_width = 2;
	a->active_speed = 32;
	a->phys_state = port_is_down(d) ? 3 : 5;
	a->link_layer = d->infiniband ? IBV_LINK_LAYER_INFINIBAND : IBV_LINK_LAYER_ETHERNET;
	return 0;
}

static int sv_query_port(struct ibv_context *c, uint8_t port, struct ibv_port_attr *a,
			 size_t len)
{
	if (len < sizeof(struct ibv_port_attr)) {
		struct ibv_port_attr full;
		int r = fill_port(c, port, &full);
		if (!r)
			memcpy(a, &full, len);
		return r;
	}
	return fill_port(c, port, a);
}

/* The old exported entry point (struct _compat_ibv_port_attr is a prefix
 * of struct ibv_port_attr). */
SV_EXPORT int ibv_query_port(struct ibv_context *c, uint8_t port, struct _compat_ibv_port_attr *a)
{
	struct ibv_port_attr full;
	int r = fill_port(c, port, &full);
	if (!r)
		memcpy(a, &full, offsetof(struct ibv_port_attr, link_layer) + 1);
	return r;
}

SV_EXPORT int ibv_query_gid(struct ibv_context *c, uint8_t port, int index, union ibv_gid *gid)
{
	struct sv_device *d = ctx_of(c)->dev;
	if (port != 1 || index < 0 || index >= d->ngids)
		return EINVAL;
	*gid = d->gids[index];
	return 0;
}

SV_EXPORT int ibv_query_gid_type(struct ibv_context *c, uint8_t port, unsigned int index,
				 enum ibv_gid_type_sysfs *type)
{
	struct sv_device *d = ctx_of(c)->dev;
	if (port != 1 || index >= (unsigned)d->ngids)
		return EINVAL;
	*type = d->gid_types[index];
	return 0;
}

static void gid_entry(struct sv_device *d, unsigned idx, struct ibv_gid_entry *e)
{
	memset(e, 0, sizeof(*e));
	e->gid = d->gids[idx];
	e->gid_index = idx;
	e->port_num = 1;
	e->gid_type = d->infiniband ? IBV_GID_TYPE_IB
		      : d->gid_types[idx] == IBV_GID_TYPE_SYSFS_ROCE_V2 ? IBV_GID_TYPE_ROCE_V2
									 : IBV_GID_TYPE_ROCE_V1;
	e->ndev_ifindex = d->infiniband ? 0 : 1;
}

SV_EXPORT int _ibv_query_gid_ex(struct ibv_context *c, uint32_t port, uint32_t index,
				struct ibv_gid_entry *entry, uint32_t flags, size_t size)
{
	(void)flags;
	struct sv_device *d = ctx_of(c)->dev;
	if (port != 1 || index >= (uint32_t)d->ngids || size < sizeof(*entry))
		return EINVAL;
	gid_entry(d, index, entry);
	return 0;
}

SV_EXPORT ssize_t _ibv_query_gid_table(struct ibv_context *c, struct ibv_gid_entry *entries,
				       size_t max, uint32_t flags, size_t size)
{
	(void)flags;
	struct sv_device *d = ctx_of(c)->dev;
	if (size < sizeof(*entries))
		return -EINVAL;
	if (max < (size_t)d->ngids)
		return -EINVAL;
	for (int k = 0; k < d->ngids; k++)
		gid_entry(d, (unsigned)k, &entries[k]);
	return d->ngids;
}

SV_EXPORT int ibv_query_pkey(struct ibv_context *c, uint8_t port, int index, __be16 *pkey)
{
	(void)c;
	if (port != 1 || index != 0)
		return EINVAL;
	*pkey = htobe16(0xffff);
	return 0;
}

SV_EXPORT struct ibv_device **ibv_get_device_list(int *num)
{
	init();
	struct ibv_device **l = calloc((size_t)g_ndevs + 1, sizeof(*l));
	if (!l) {
		errno = ENOMEM;
		return NULL;
	}
	for (int i = 0; i < g_ndevs; i++)
		l[i] = &g_devs[i].dev;
	if (num)
		*num = g_ndevs;
	return l;
}

SV_EXPORT void ibv_free_device_list(struct ibv_device **l)
{
	free(l);
}

SV_EXPORT const char *ibv_get_device_name(struct ibv_device *d)
{
	return d->name;
}

SV_EXPORT __be64 ibv_get_device_guid(struct ibv_device *d)
{
	return htobe64(((struct sv_device *)d)->guid);
}

SV_EXPORT const char *ibv_get_sysfs_path(void)
{
	init();
	return g_sysfs;
}

SV_EXPORT struct ibv_context *ibv_open_device(struct ibv_device *device)
{
	init();
	struct sv_device *d = device_named(device->name);
	if (!d || fail_at("open")) {
		errno = ENODEV;
		return NULL;
	}
	struct sv_context *c = calloc(1, sizeof(*c));
	if (!c)
		return NULL;
	c->dev = d;
	struct ibv_context *ctx = &c->vctx.context;
	ctx->device = &d->dev;
	ctx->cmd_fd = -1;
	/* Blocking, as libibverbs opens it; callers set O_NONBLOCK. */
	ctx->async_fd = eventfd(0, EFD_CLOEXEC);
	c->port_reported_down = port_is_down(d);
	ctx->num_comp_vectors = 1;
	pthread_mutex_init(&ctx->mutex, NULL);
	ctx->abi_compat = __VERBS_ABI_IS_EXTENDED;
	ctx->ops.poll_cq = sv_poll_cq;
	ctx->ops.req_notify_cq = sv_req_notify_cq;
	ctx->ops.post_send = sv_post_send;
	ctx->ops.post_recv = sv_post_recv;
	c->vctx.sz = sizeof(struct verbs_context);
	c->vctx.query_port = sv_query_port;
	c->vctx.query_device_ex = sv_query_device_ex;
	c->vctx.create_cq_ex = sv_create_cq_ex;
	c->vctx.create_qp_ex = sv_create_qp_ex;
	return ctx;
}

SV_EXPORT int ibv_close_device(struct ibv_context *ctx)
{
	struct sv_context *c = ctx_of(ctx);
	if (ctx->async_fd >= 0)
		close(ctx->async_fd);
	free(c);
	return 0;
}

SV_EXPORT struct ibv_pd *ibv_alloc_pd(struct ibv_context *ctx)
{
	struct sv_pd *p = calloc(1, sizeof(*p));
	if (!p)
		return NULL;
	p->pd.context = ctx;
	p->pd.handle = (uint32_t)atomic_fetch_add(&g_pd_counter, 1);
	p->key = ((uint64_t)g_pid << 32) | (p->pd.handle + 1);
	return &p->pd;
}

SV_EXPORT int ibv_dealloc_pd(struct ibv_pd *pd)
{
	struct sv_pd *p = (struct sv_pd *)pd;
	if (atomic_load(&p->users))
		return EBUSY;
	free(p);
	return 0;
}

static int range_mapped(void *addr, size_t len)
{
	long page = sysconf(_SC_PAGESIZE);
	uintptr_t a = (uintptr_t)addr & ~(uintptr_t)(page - 1);
	size_t n = (((uintptr_t)addr + len - a) + (size_t)page - 1) / (size_t)page;
	unsigned char vec[4096];
	/* mincore fails with ENOMEM on any unmapped page of the range. */
	for (size_t done = 0; done < n; done += sizeof(vec)) {
		size_t k = n - done < sizeof(vec) ? n - done : sizeof(vec);
		if (mincore((void *)(a + done * (size_t)page), k * (size_t)page, vec) != 0)
			return 0;
	}
	return 1;
}

SV_EXPORT struct ibv_mr *ibv_reg_mr_iova2(struct ibv_pd *pd, void *addr, size_t length,
					  uint64_t iova, unsigned int access)
{
	init();
	struct sv_pd *p = (struct sv_pd *)pd;
	if (!g_reg) {
		errno = ENODEV;
		return NULL;
	}
	if (fail_at("reg_mr")) {
		errno = ENOMEM;
		return NULL;
	}
	/* Optional bits (relaxed ordering, …) are honoured or ignored, as
	 * rdma-core does; any other unknown bit is refused. */
	access &= ~(unsigned)IBV_ACCESS_OPTIONAL_RANGE;
	const unsigned known = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
			       IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC |
			       IBV_ACCESS_MW_BIND | IBV_ACCESS_ZERO_BASED |
			       IBV_ACCESS_ON_DEMAND | IBV_ACCESS_HUGETLB;
	if (access & ~known) {
		errno = EINVAL;
		return NULL;
	}
	/* Remote write (and atomics) need local write, as on every NIC. */
	if ((access & (IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_ATOMIC)) &&
	    !(access & IBV_ACCESS_LOCAL_WRITE)) {
		errno = EINVAL;
		return NULL;
	}
	if (length == 0 || iova != (uint64_t)(uintptr_t)addr) {
		errno = EINVAL;
		return NULL;
	}
	if (!range_mapped(addr, length)) {
		errno = EFAULT;
		return NULL;
	}
	long cap = env_long("SOFTVERBS_MEMLOCK_BYTES", 0);
	uint64_t before = atomic_fetch_add(&g_registered_bytes, length);
	if (cap > 0 && before + length > (uint64_t)cap) {
		atomic_fetch_sub(&g_registered_bytes, length);
		errno = ENOMEM; /* what RLIMIT_MEMLOCK gives */
		return NULL;
	}
	struct sv_mr *m = calloc(1, sizeof(*m));
	int slot = claim(&g_reg->mrs[0].owner, sizeof(struct sv_mr_slot), SV_MR_SLOTS,
			 g_pid * 40503u);
	if (!m || slot < 0) {
		free(m);
		atomic_fetch_sub(&g_registered_bytes, length);
		errno = ENOMEM;
		return NULL;
	}
	struct sv_mr_slot *s = &g_reg->mrs[slot];
	s->gen = (s->gen + 1) & 0xffff;
	if (s->gen == 0)
		s->gen = 1;
	uint32_t key = (uint32_t)slot | (s->gen << 16);
	s->access = access;
	s->pd = p->key;
	s->addr = (uint64_t)(uintptr_t)addr;
	s->len = length;
	atomic_store(&s->key, key);
	m->slot = (uint32_t)slot;
	m->bytes = length;
	m->mr.context = pd->context;
	m->mr.pd = pd;
	m->mr.addr = addr;
	m->mr.length = length;
	m->mr.handle = (uint32_t)slot;
	m->mr.lkey = key;
	m->mr.rkey = key;
	atomic_fetch_add(&p->users, 1);
	return &m->mr;
}

SV_EXPORT struct ibv_mr *ibv_reg_mr(struct ibv_pd *pd, void *addr, size_t length, int access)
{
	return ibv_reg_mr_iova2(pd, addr, length, (uint64_t)(uintptr_t)addr, (unsigned)access);
}

SV_EXPORT struct ibv_mr *ibv_reg_mr_iova(struct ibv_pd *pd, void *addr, size_t length,
					 uint64_t iova, int access)
{
	return ibv_reg_mr_iova2(pd, addr, length, iova, (unsigned)access);
}

SV_EXPORT struct ibv_mr *ibv_reg_dmabuf_mr(struct ibv_pd *pd, uint64_t offset, size_t length,
					   uint64_t iova, int fd, int access)
{
	(void)pd;
	(void)offset;
	(void)length;
	(void)iova;
	(void)fd;
	(void)access;
	errno = EOPNOTSUPP;
	return NULL;
}

SV_EXPORT int ibv_dereg_mr(struct ibv_mr *mr)
{
	struct sv_mr *m = (struct sv_mr *)mr;
	struct sv_mr_slot *s = &g_reg->mrs[m->slot];
	atomic_store(&s->key, 0);
	atomic_store(&s->owner, 0);
	atomic_fetch_sub(&g_registered_bytes, m->bytes);
	atomic_fetch_sub(&((struct sv_pd *)mr->pd)->users, 1);
	free(m);
	return 0;
}

/* ------------------------------------------------------ the small rest */

SV_EXPORT int ibv_fork_init(void)
{
	return 0;
}

SV_EXPORT enum ibv_fork_status ibv_is_fork_initialized(void)
{
	return IBV_FORK_ENABLED;
}

/* The next event of `ctx`, if any: a port whose state changed since it
 * was last reported, or a QP of this context that a peer's request moved
 * to the error state. */
static int next_event(struct ibv_context *ctx, struct ibv_async_event *event)
{
	struct sv_context *c = ctx_of(ctx);
	int down = port_is_down(c->dev);
	if (down != c->port_reported_down) {
		c->port_reported_down = down;
		event->element.port_num = 1;
		event->event_type = down ? IBV_EVENT_PORT_ERR : IBV_EVENT_PORT_ACTIVE;
		return 1;
	}
	int found = 0;
	pthread_mutex_lock(&g_lock);
	for (struct sv_qp *q = g_qps; q && !found; q = q->next) {
		if (q->ctx != c || q->err_seen || qp_state(q) != IBV_QPS_ERR)
			continue;
		q->err_seen = 1;
		q->ex.qp_base.state = IBV_QPS_ERR;
		event->element.qp = &q->ex.qp_base;
		event->event_type = IBV_EVENT_QP_ACCESS_ERR;
		found = 1;
	}
	pthread_mutex_unlock(&g_lock);
	return found;
}

SV_EXPORT int ibv_get_async_event(struct ibv_context *ctx, struct ibv_async_event *event)
{
	int nonblocking = (fcntl(ctx->async_fd, F_GETFL) & O_NONBLOCK) != 0;
	for (;;) {
		if (next_event(ctx, event))
			return 0;
		if (nonblocking) {
			errno = EAGAIN;
			return -1;
		}
		usleep(10000);
	}
}

SV_EXPORT void ibv_ack_async_event(struct ibv_async_event *event)
{
	(void)event;
}

SV_EXPORT const char *ibv_wc_status_str(enum ibv_wc_status status)
{
	static const char *const s[] = {
		[IBV_WC_SUCCESS] = "success",
		[IBV_WC_LOC_LEN_ERR] = "local length error",
		[IBV_WC_LOC_QP_OP_ERR] = "local QP operation error",
		[IBV_WC_LOC_EEC_OP_ERR] = "local EE context operation error",
		[IBV_WC_LOC_PROT_ERR] = "local protection error",
		[IBV_WC_WR_FLUSH_ERR] = "Work Request Flushed Error",
		[IBV_WC_MW_BIND_ERR] = "memory management operation error",
		[IBV_WC_BAD_RESP_ERR] = "bad response error",
		[IBV_WC_LOC_ACCESS_ERR] = "local access error",
		[IBV_WC_REM_INV_REQ_ERR] = "remote invalid request error",
		[IBV_WC_REM_ACCESS_ERR] = "remote access error",
		[IBV_WC_REM_OP_ERR] = "remote operation error",
		[IBV_WC_RETRY_EXC_ERR] = "transport retry counter exceeded",
		[IBV_WC_RNR_RETRY_EXC_ERR] = "RNR retry counter exceeded",
	};
	if ((unsigned)status < sizeof(s) / sizeof(s[0]) && s[status])
		return s[status];
	return "unknown";
}

/* Test hook: work requests executed by this process's QPs on `name`. */
SV_EXPORT uint64_t softverbs_device_wrs(const char *name)
{
	init();
	struct sv_device *d = device_named(name);
	return d ? atomic_load(&g_dev_wrs[d->idx]) : 0;
}

/* Test hook: takes `name`'s port down (up = 0) or up, host-wide, and says
 * so in the sysfs tree too. */
SV_EXPORT int softverbs_set_port(const char *name, int up)
{
	init();
	struct sv_device *d = device_named(name);
	if (!d || !g_reg)
		return ENODEV;
	atomic_store(&g_reg->port_down[d->idx], up ? 0u : 1u);
	char q[512];
	snprintf(q, sizeof(q), "%s/class/infiniband/%s/ports/1/state", g_sysfs, d->dev.name);
	write_file(q, port_is_down(d) ? "1: DOWN\n" : "4: ACTIVE\n");
	return 0;
}

/* Test hook: inline WRITEs this process's QPs executed. */
SV_EXPORT uint64_t softverbs_inline_wrs(void)
{
	return atomic_load(&g_inline_wrs);
}

/* Test hook: completion queues this process holds. */
SV_EXPORT int64_t softverbs_live_cqs(void)
{
	return atomic_load(&g_live_cqs);
}
