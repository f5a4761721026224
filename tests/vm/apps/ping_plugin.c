/*
 * A plugin library linked against libibverbs the ordinary way, for a host that loads it
 * with dlopen(RTLD_LOCAL): the way NCCL's network plugins, UCX's transport modules and
 * Python extension modules reach the verbs. libibverbs then comes into the process as a
 * local dependency of the plugin, invisible to the global scope, while the plugin's own
 * calls bind through the global scope first (where an LD_PRELOAD library sits).
 *
 * ping_plugin_run(device, out, len) opens the device, connects two RC QPs to each other,
 * RDMA WRITEs 256 KiB (unsignaled) and SENDs a ping from A to B, and B SENDs back the
 * checksum of what it received. It writes a "result" line to out and returns 0, or
 * returns the errno of the verb that failed (and says which on stderr).
 */
#include "common.h"

#define WRITE_LEN (256 * 1024)
#define MSG_LEN 64

static uint32_t fnv1a(const unsigned char *p, size_t n)
{
	uint32_t h = 2166136261u;
	for (size_t i = 0; i < n; i++)
		h = (h ^ p[i]) * 16777619u;
	return h;
}

/* Fails with the verb's errno, said on stderr. */
#define CHECK(cond, what)                                                                              \
	do {                                                                                           \
		if (!(cond)) {                                                                         \
			int e_ = errno ? errno : EIO;                                                  \
			fprintf(stderr, "ping_plugin: error: %s: %s (errno %d)\n", what, strerror(e_), e_); \
			return e_;                                                                     \
		}                                                                                      \
	} while (0)

__attribute__((visibility("default"))) int ping_plugin_run(const char *device, char *out, size_t out_len)
{
	struct ibv_device **list;
	struct ibv_context *ctx = NULL;
	struct ibv_port_attr port;
	struct ibv_wc wc;
	int n = 0;

	errno = 0;
	list = ibv_get_device_list(&n);
	CHECK(list, "ibv_get_device_list");
	for (int i = 0; i < n && !ctx; i++) {
		if (strcmp(ibv_get_device_name(list[i]), device) == 0) {
			errno = 0;
			ctx = ibv_open_device(list[i]);
			CHECK(ctx, "ibv_open_device");
		}
	}
	ibv_free_device_list(list);
	errno = ENODEV;
	CHECK(ctx, "no such device");
	errno = ibv_query_port(ctx, 1, &port);
	CHECK(errno == 0, "ibv_query_port");
	struct ibv_pd *pd = ibv_alloc_pd(ctx);
	CHECK(pd, "ibv_alloc_pd");
	struct ibv_cq *cq_a = ibv_create_cq(ctx, 16, NULL, NULL, 0);
	struct ibv_cq *cq_b = ibv_create_cq(ctx, 16, NULL, NULL, 0);
	CHECK(cq_a && cq_b, "ibv_create_cq");
	struct ibv_qp *a = create_rc_qp(pd, cq_a, cq_a, 16, 4);
	struct ibv_qp *b = create_rc_qp(pd, cq_b, cq_b, 16, 4);
	connect_qp(a, 1, 0, b->qp_num);
	connect_qp(b, 1, 0, a->qp_num);
	size_t len = WRITE_LEN + 2 * MSG_LEN;
	char *ba = calloc(1, len), *bb = calloc(1, len);
	errno = ENOMEM;
	CHECK(ba && bb, "calloc");
	struct ibv_mr *ma = ibv_reg_mr(pd, ba, len, IBV_ACCESS_LOCAL_WRITE);
	struct ibv_mr *mb = ibv_reg_mr(pd, bb, len, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
	CHECK(ma && mb, "ibv_reg_mr");
	for (size_t i = 0; i < WRITE_LEN; i++)
		ba[i] = (char)(i * 7 + (i >> 12));
	uint32_t sent = fnv1a((unsigned char *)ba, WRITE_LEN);
	post_recv_one(b, 10, mb, bb + WRITE_LEN + MSG_LEN, MSG_LEN);
	post_recv_one(a, 20, ma, ba + WRITE_LEN + MSG_LEN, MSG_LEN);
	post_one(a, IBV_WR_RDMA_WRITE, 1, ma, ba, WRITE_LEN, (uintptr_t)bb, mb->rkey, 0);
	snprintf(ba + WRITE_LEN, MSG_LEN, "ping");
	post_one(a, IBV_WR_SEND, 2, ma, ba + WRITE_LEN, MSG_LEN, 0, 0, 1);
	errno = ETIMEDOUT;
	CHECK(poll_one(cq_b, &wc, 30, "B's receive of the ping") && wc.wr_id == 10, "B's receive of the ping");
	uint32_t got = fnv1a((unsigned char *)bb, WRITE_LEN);
	snprintf(bb + WRITE_LEN, MSG_LEN, "pong %08x", got);
	post_one(b, IBV_WR_SEND, 11, mb, bb + WRITE_LEN, MSG_LEN, 0, 0, 1);
	CHECK(poll_one(cq_b, &wc, 30, "B's reply") && wc.wr_id == 11, "B's reply");
	/* A's SEND completion and B's reply share A's CQ, in either order. */
	CHECK(poll_one(cq_a, &wc, 30, "A's completions"), "A's first completion");
	CHECK(poll_one(cq_a, &wc, 30, "A's completions"), "A's second completion");
	snprintf(out, out_len, "result device=%s port_state=%d active_mtu=%d write_bytes=%d sent=%08x reply=\"%s\"",
		 device, port.state, port.active_mtu, WRITE_LEN, sent, ba + WRITE_LEN + MSG_LEN);
	ibv_destroy_qp(a);
	ibv_destroy_qp(b);
	ibv_dereg_mr(ma);
	ibv_dereg_mr(mb);
	ibv_destroy_cq(cq_a);
	ibv_destroy_cq(cq_b);
	ibv_dealloc_pd(pd);
	errno = ibv_close_device(ctx);
	CHECK(errno == 0, "ibv_close_device");
	free(ba);
	free(bb);
	errno = EBADMSG;
	CHECK(got == sent, "B's checksum differs from A's");
	return 0;
}
