/*
 * An application that does not link libibverbs but loads it at run time with
 * dlopen("libibverbs.so.1", RTLD_NOW | RTLD_LOCAL), as NCCL, UCX's transport modules and
 * language bindings do, and finds every verb with dlsym on that handle. It lists the
 * devices, opens one, creates a PD, CQs and two RC QPs connected to each other, and runs a
 * ping exchange over them: A WRITEs 256 KiB into B's buffer (unsignaled) and SENDs a ping;
 * B checks the written bytes and SENDs back their checksum. It prints one "result" line
 * that must be the same plain, under the unconfigured shaper and shaped.
 *
 * With --plugin it instead loads PLUGIN (ping_plugin.c: a library linked against
 * libibverbs) with dlopen(RTLD_NOW | RTLD_LOCAL) and runs the same exchange through it, as
 * a host loads a network plugin or an extension module: the plugin's verbs calls bind
 * through the global scope, while libibverbs itself is only in the plugin's local scope.
 *
 *   dlopen_app [DEVICE [GID_INDEX]]      (default rxe0, GID index 0)
 *   dlopen_app --plugin PLUGIN [DEVICE]
 *
 * Exit status: 0 on success, 2 on any failure (with the verb, its errno and its text).
 */
#include <dlfcn.h>
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <infiniband/verbs.h>

#define WRITE_LEN (256 * 1024)
#define MSG_LEN 64

static void fail(int errnum, const char *what)
{
	if (errnum)
		fprintf(stderr, "dlopen_app: error: %s: %s (errno %d)\n", what, strerror(errnum), errnum);
	else
		fprintf(stderr, "dlopen_app: error: %s\n", what);
	exit(2);
}

/* The verbs, as found in the handle dlopen returned. */
static struct {
	struct ibv_device **(*get_device_list)(int *);
	void (*free_device_list)(struct ibv_device **);
	const char *(*get_device_name)(struct ibv_device *);
	struct ibv_context *(*open_device)(struct ibv_device *);
	int (*close_device)(struct ibv_context *);
	int (*query_port)(struct ibv_context *, uint8_t, struct ibv_port_attr *);
	int (*query_gid)(struct ibv_context *, uint8_t, int, union ibv_gid *);
	struct ibv_pd *(*alloc_pd)(struct ibv_context *);
	int (*dealloc_pd)(struct ibv_pd *);
	struct ibv_cq *(*create_cq)(struct ibv_context *, int, void *, struct ibv_comp_channel *, int);
	int (*destroy_cq)(struct ibv_cq *);
	struct ibv_qp *(*create_qp)(struct ibv_pd *, struct ibv_qp_init_attr *);
	int (*destroy_qp)(struct ibv_qp *);
	int (*modify_qp)(struct ibv_qp *, struct ibv_qp_attr *, int);
	struct ibv_mr *(*reg_mr)(struct ibv_pd *, void *, size_t, int);
	int (*dereg_mr)(struct ibv_mr *);
	const char *(*wc_status_str)(enum ibv_wc_status);
} v;

static void *sym(void *h, const char *name)
{
	void *p = dlsym(h, name);
	if (!p) {
		fprintf(stderr, "dlopen_app: error: dlsym(%s): %s\n", name, dlerror());
		exit(2);
	}
	return p;
}

/* A verb: by dlsym, or at VERBS_BY_VERSION with dlvsym (nccl_style_app.c). */
static void *verb(void *h, const char *name)
{
#ifdef VERBS_BY_VERSION
	void *p = dlvsym(h, name, VERBS_BY_VERSION);
	if (!p) {
		fprintf(stderr, "dlopen_app: error: dlvsym(%s, %s): %s\n", name, VERBS_BY_VERSION, dlerror());
		exit(2);
	}
	return p;
#else
	return sym(h, name);
#endif
}

static void load(void)
{
	void *h;
	/* Said for the log: whether anything (the shaper, say) had loaded it already. */
	h = dlopen("libibverbs.so.1", RTLD_NOW | RTLD_NOLOAD);
	printf("dlopen_app: libibverbs.so.1 %s before dlopen\n", h ? "was already loaded" : "was not loaded");
	if (h)
		dlclose(h);
	h = dlopen("libibverbs.so.1", RTLD_NOW | RTLD_LOCAL);
	if (!h) {
		fprintf(stderr, "dlopen_app: error: dlopen(libibverbs.so.1): %s\n", dlerror());
		exit(2);
	}
	*(void **)&v.get_device_list = verb(h, "ibv_get_device_list");
	*(void **)&v.free_device_list = verb(h, "ibv_free_device_list");
	*(void **)&v.get_device_name = verb(h, "ibv_get_device_name");
	*(void **)&v.open_device = verb(h, "ibv_open_device");
	*(void **)&v.close_device = verb(h, "ibv_close_device");
	*(void **)&v.query_port = verb(h, "ibv_query_port");
	*(void **)&v.query_gid = verb(h, "ibv_query_gid");
	*(void **)&v.alloc_pd = verb(h, "ibv_alloc_pd");
	*(void **)&v.dealloc_pd = verb(h, "ibv_dealloc_pd");
	*(void **)&v.create_cq = verb(h, "ibv_create_cq");
	*(void **)&v.destroy_cq = verb(h, "ibv_destroy_cq");
	*(void **)&v.create_qp = verb(h, "ibv_create_qp");
	*(void **)&v.destroy_qp = verb(h, "ibv_destroy_qp");
	*(void **)&v.modify_qp = verb(h, "ibv_modify_qp");
	*(void **)&v.reg_mr = verb(h, "ibv_reg_mr");
	*(void **)&v.dereg_mr = verb(h, "ibv_dereg_mr");
	*(void **)&v.wc_status_str = verb(h, "ibv_wc_status_str");
}

static void to_rts(struct ibv_qp *qp, int gid_index, uint32_t remote_qpn, enum ibv_mtu mtu)
{
	union ibv_gid gid;
	struct ibv_qp_attr a;
	int rc;
	if ((rc = v.query_gid(qp->context, 1, gid_index, &gid)))
		fail(rc, "ibv_query_gid");
	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_INIT;
	a.port_num = 1;
	a.qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;
	if ((rc = v.modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS)))
		fail(rc, "ibv_modify_qp(INIT)");
	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_RTR;
	a.path_mtu = mtu;
	a.dest_qp_num = remote_qpn;
	a.max_dest_rd_atomic = 1;
	a.min_rnr_timer = 12;
	a.ah_attr.is_global = 1;
	a.ah_attr.grh.dgid = gid;
	a.ah_attr.grh.sgid_index = (uint8_t)gid_index;
	a.ah_attr.grh.hop_limit = 1;
	a.ah_attr.port_num = 1;
	if ((rc = v.modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
				  IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER)))
		fail(rc, "ibv_modify_qp(RTR)");
	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_RTS;
	a.timeout = 14;
	a.retry_cnt = 7;
	a.rnr_retry = 7;
	a.max_rd_atomic = 1;
	if ((rc = v.modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
				  IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC)))
		fail(rc, "ibv_modify_qp(RTS)");
}

static void post(struct ibv_qp *qp, enum ibv_wr_opcode op, uint64_t wr_id, struct ibv_mr *mr, char *addr,
		 uint32_t len, uint64_t raddr, uint32_t rkey, int signaled)
{
	struct ibv_sge sge = {.addr = (uintptr_t)addr, .length = len, .lkey = mr->lkey};
	struct ibv_send_wr wr, *bad = NULL;
	int rc;
	memset(&wr, 0, sizeof(wr));
	wr.wr_id = wr_id;
	wr.sg_list = &sge;
	wr.num_sge = 1;
	wr.opcode = op;
	wr.send_flags = signaled ? IBV_SEND_SIGNALED : 0;
	wr.wr.rdma.remote_addr = raddr;
	wr.wr.rdma.rkey = rkey;
	if ((rc = ibv_post_send(qp, &wr, &bad)))
		fail(rc, "ibv_post_send");
}

static void post_recv(struct ibv_qp *qp, uint64_t wr_id, struct ibv_mr *mr, char *addr, uint32_t len)
{
	struct ibv_sge sge = {.addr = (uintptr_t)addr, .length = len, .lkey = mr->lkey};
	struct ibv_recv_wr wr, *bad = NULL;
	int rc;
	memset(&wr, 0, sizeof(wr));
	wr.wr_id = wr_id;
	wr.sg_list = &sge;
	wr.num_sge = 1;
	if ((rc = ibv_post_recv(qp, &wr, &bad)))
		fail(rc, "ibv_post_recv");
}

/* Waits up to 30 s for one successful completion with wr_id on cq. */
static void wait_wc(struct ibv_cq *cq, uint64_t wr_id, const char *what)
{
	struct ibv_wc wc;
	time_t deadline = time(NULL) + 30;
	char msg[160];
	for (;;) {
		int n = ibv_poll_cq(cq, 1, &wc);
		if (n < 0)
			fail(0, "ibv_poll_cq failed");
		if (n == 1) {
			if (wc.status != IBV_WC_SUCCESS || wc.wr_id != wr_id) {
				snprintf(msg, sizeof(msg), "%s: completion wr_id %llu status %s", what,
					 (unsigned long long)wc.wr_id, v.wc_status_str(wc.status));
				fail(0, msg);
			}
			return;
		}
		if (time(NULL) > deadline) {
			snprintf(msg, sizeof(msg), "%s: no completion in 30 s", what);
			fail(0, msg);
		}
	}
}

static uint32_t checksum(const unsigned char *p, size_t n)
{
	uint32_t h = 2166136261u; /* FNV-1a */
	for (size_t i = 0; i < n; i++)
		h = (h ^ p[i]) * 16777619u;
	return h;
}

/* The --plugin form: the exchange runs inside a library loaded with RTLD_LOCAL. */
static int run_plugin(const char *path, const char *device)
{
	char result[256] = "";
	void *h = dlopen("libibverbs.so.1", RTLD_NOW | RTLD_NOLOAD);
	printf("dlopen_app: libibverbs.so.1 %s before dlopen\n", h ? "was already loaded" : "was not loaded");
	if (h)
		dlclose(h);
	h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
	if (!h) {
		fprintf(stderr, "dlopen_app: error: dlopen(%s): %s\n", path, dlerror());
		return 2;
	}
	int (*run)(const char *, char *, size_t);
	*(void **)&run = sym(h, "ping_plugin_run");
	int rc = run(device, result, sizeof(result));
	if (rc) {
		fprintf(stderr, "dlopen_app: error: the plugin's exchange failed: %s (errno %d)\n", strerror(rc), rc);
		return 2;
	}
	printf("dlopen_app: %s\n", result);
	return 0;
}

int main(int argc, char **argv)
{
	setvbuf(stdout, NULL, _IOLBF, 0);
	if (argc > 2 && strcmp(argv[1], "--plugin") == 0)
		return run_plugin(argv[2], argc > 3 ? argv[3] : "rxe0");
	const char *name = argc > 1 ? argv[1] : "rxe0";
	int gid_index = argc > 2 ? atoi(argv[2]) : 0;
	struct ibv_device **list;
	struct ibv_context *ctx = NULL;
	struct ibv_port_attr port;
	int n = 0, rc;

	load();
	list = v.get_device_list(&n);
	if (!list)
		fail(errno, "ibv_get_device_list");
	printf("dlopen_app: %d device(s):", n);
	for (int i = 0; i < n; i++)
		printf(" %s", v.get_device_name(list[i]));
	printf("\n");
	for (int i = 0; i < n && !ctx; i++) {
		if (strcmp(v.get_device_name(list[i]), name) == 0) {
			errno = 0;
			ctx = v.open_device(list[i]);
			if (!ctx)
				fail(errno, "ibv_open_device");
		}
	}
	v.free_device_list(list);
	if (!ctx)
		fail(0, "the device is not in the list");
	memset(&port, 0, sizeof(port));
	if ((rc = v.query_port(ctx, 1, &port)))
		fail(rc, "ibv_query_port");

	struct ibv_pd *pd = v.alloc_pd(ctx);
	if (!pd)
		fail(errno, "ibv_alloc_pd");
	/* Room for a QP's 16 sends and 16 receives: the shaper shapes a QP only if its CQ
	 * holds every completion both queues may have waiting. */
	struct ibv_cq *cq_a = v.create_cq(ctx, 32, NULL, NULL, 0);
	struct ibv_cq *cq_b = v.create_cq(ctx, 32, NULL, NULL, 0);
	if (!cq_a || !cq_b)
		fail(errno, "ibv_create_cq");
	struct ibv_qp_init_attr ia;
	memset(&ia, 0, sizeof(ia));
	ia.qp_type = IBV_QPT_RC;
	ia.cap.max_send_wr = 16;
	ia.cap.max_recv_wr = 16;
	ia.cap.max_send_sge = 1;
	ia.cap.max_recv_sge = 1;
	ia.send_cq = ia.recv_cq = cq_a;
	struct ibv_qp *a = v.create_qp(pd, &ia);
	ia.send_cq = ia.recv_cq = cq_b;
	struct ibv_qp *b = v.create_qp(pd, &ia);
	if (!a || !b)
		fail(errno, "ibv_create_qp");
	to_rts(a, gid_index, b->qp_num, port.active_mtu);
	to_rts(b, gid_index, a->qp_num, port.active_mtu);

	/* Per side: the WRITE area, then a send and a receive message slot. */
	size_t len = WRITE_LEN + 2 * MSG_LEN;
	char *buf_a = calloc(1, len), *buf_b = calloc(1, len);
	if (!buf_a || !buf_b)
		fail(ENOMEM, "calloc");
	struct ibv_mr *mr_a = v.reg_mr(pd, buf_a, len, IBV_ACCESS_LOCAL_WRITE);
	struct ibv_mr *mr_b = v.reg_mr(pd, buf_b, len, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
	if (!mr_a || !mr_b)
		fail(errno, "ibv_reg_mr");
	for (size_t i = 0; i < WRITE_LEN; i++)
		buf_a[i] = (char)(i * 7 + (i >> 12));
	uint32_t sent_sum = checksum((unsigned char *)buf_a, WRITE_LEN);

	post_recv(b, 10, mr_b, buf_b + WRITE_LEN + MSG_LEN, MSG_LEN);
	post_recv(a, 20, mr_a, buf_a + WRITE_LEN + MSG_LEN, MSG_LEN);
	post(a, IBV_WR_RDMA_WRITE, 1, mr_a, buf_a, WRITE_LEN, (uintptr_t)buf_b, mr_b->rkey, 0);
	snprintf(buf_a + WRITE_LEN, MSG_LEN, "ping");
	post(a, IBV_WR_SEND, 2, mr_a, buf_a + WRITE_LEN, MSG_LEN, 0, 0, 1);
	/* B: the ping arrives after the WRITE's bytes (RC orders them). */
	wait_wc(cq_b, 10, "B's receive of the ping");
	uint32_t got_sum = checksum((unsigned char *)buf_b, WRITE_LEN);
	snprintf(buf_b + WRITE_LEN, MSG_LEN, "pong %08x", got_sum);
	post(b, IBV_WR_SEND, 11, mr_b, buf_b + WRITE_LEN, MSG_LEN, 0, 0, 1);
	wait_wc(cq_b, 11, "B's reply");
	/* A: its SEND's completion, then B's reply (one CQ, so in either order). */
	struct ibv_wc wc[2];
	int have = 0;
	time_t deadline = time(NULL) + 30;
	while (have < 2) {
		int k = ibv_poll_cq(cq_a, 2 - have, wc + have);
		if (k < 0)
			fail(0, "ibv_poll_cq failed");
		for (int i = have; i < have + k; i++)
			if (wc[i].status != IBV_WC_SUCCESS)
				fail(0, "A's completion has an error status");
		have += k;
		if (have < 2 && time(NULL) > deadline)
			fail(0, "A: its SEND's completion and B's reply did not both arrive in 30 s");
	}
	const char *reply = buf_a + WRITE_LEN + MSG_LEN;
	printf("dlopen_app: result device=%s port_state=%d active_mtu=%d write_bytes=%d sent=%08x reply=\"%s\"\n",
	       name, port.state, port.active_mtu, WRITE_LEN, sent_sum, reply);

	v.destroy_qp(a);
	v.destroy_qp(b);
	v.dereg_mr(mr_a);
	v.dereg_mr(mr_b);
	v.destroy_cq(cq_a);
	v.destroy_cq(cq_b);
	v.dealloc_pd(pd);
	if ((rc = v.close_device(ctx)))
		fail(rc, "ibv_close_device");
	free(buf_a);
	free(buf_b);
	if (got_sum != sent_sum) {
		fprintf(stderr, "dlopen_app: error: B read checksum %08x, A wrote %08x\n", got_sum, sent_sum);
		return 2;
	}
	return 0;
}
