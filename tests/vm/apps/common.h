/*
 * Helpers shared by the guest's test applications that link libibverbs the ordinary way:
 * fatal errors with context, opening a device by name, moving an RC QP to RTS against a
 * peer on the same port (loopback inside Soft-RoCE), and polling a CQ with a deadline.
 * These programs exist to behave like real C applications under the shaper, so they use
 * only the public verbs API, exactly as an application would.
 */
#ifndef JUSTITIA_VM_APPS_COMMON_H
#define JUSTITIA_VM_APPS_COMMON_H

#include <errno.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <infiniband/verbs.h>

/* The program's name in messages, set by each main(). */
static const char *app_name = "app";

/* Prints "name: error: ..." (with errno's text when errnum != 0) and exits with 2. */
static void die(int errnum, const char *fmt, ...) __attribute__((noreturn, format(printf, 2, 3)));
static void die(int errnum, const char *fmt, ...)
{
	va_list ap;
	fprintf(stderr, "%s: error: ", app_name);
	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	if (errnum)
		fprintf(stderr, ": %s (errno %d)", strerror(errnum), errnum);
	fputc('\n', stderr);
	exit(2);
}

static inline double now_s(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

/* Opens the device called name; dies when there is none or it cannot be opened. */
static inline struct ibv_context *open_device(const char *name)
{
	int n = 0;
	struct ibv_device **list = ibv_get_device_list(&n);
	struct ibv_context *ctx = NULL;
	if (!list)
		die(errno, "ibv_get_device_list");
	for (int i = 0; i < n; i++) {
		if (strcmp(ibv_get_device_name(list[i]), name) == 0) {
			ctx = ibv_open_device(list[i]);
			if (!ctx)
				die(errno, "ibv_open_device(%s)", name);
		}
	}
	ibv_free_device_list(list);
	if (!ctx)
		die(0, "no device %s among %d", name, n);
	return ctx;
}

/* Moves qp through INIT and RTR to RTS, connected to remote_qpn on the same port and GID
 * (both ends live on one device: rxe loops the traffic back). */
static inline void connect_qp(struct ibv_qp *qp, uint8_t port, int gid_index, uint32_t remote_qpn)
{
	union ibv_gid gid;
	struct ibv_port_attr pattr;
	struct ibv_qp_attr a;
	int rc;

	if ((rc = ibv_query_port(qp->context, port, &pattr)))
		die(rc, "ibv_query_port(%u)", port);
	if ((rc = ibv_query_gid(qp->context, port, gid_index, &gid)))
		die(rc, "ibv_query_gid(%u, %d)", port, gid_index);

	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_INIT;
	a.port_num = port;
	a.qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
	if ((rc = ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS)))
		die(rc, "ibv_modify_qp(%#x, INIT)", qp->qp_num);

	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_RTR;
	a.path_mtu = pattr.active_mtu;
	a.dest_qp_num = remote_qpn;
	a.rq_psn = 0;
	a.max_dest_rd_atomic = 1;
	a.min_rnr_timer = 12;
	a.ah_attr.is_global = 1;
	a.ah_attr.grh.dgid = gid;
	a.ah_attr.grh.sgid_index = (uint8_t)gid_index;
	a.ah_attr.grh.hop_limit = 1;
	a.ah_attr.port_num = port;
	if ((rc = ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
				IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER)))
		die(rc, "ibv_modify_qp(%#x, RTR)", qp->qp_num);

	memset(&a, 0, sizeof(a));
	a.qp_state = IBV_QPS_RTS;
	a.timeout = 14;
	a.retry_cnt = 7;
	a.rnr_retry = 7;
	a.sq_psn = 0;
	a.max_rd_atomic = 1;
	if ((rc = ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
				IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC)))
		die(rc, "ibv_modify_qp(%#x, RTS)", qp->qp_num);
}

/* An RC QP on pd with the given CQs and depths, signaled only on request. */
static inline struct ibv_qp *create_rc_qp(struct ibv_pd *pd, struct ibv_cq *send_cq, struct ibv_cq *recv_cq,
				   uint32_t max_send_wr, uint32_t max_recv_wr)
{
	struct ibv_qp_init_attr ia;
	struct ibv_qp *qp;
	memset(&ia, 0, sizeof(ia));
	ia.send_cq = send_cq;
	ia.recv_cq = recv_cq;
	ia.qp_type = IBV_QPT_RC;
	ia.cap.max_send_wr = max_send_wr;
	ia.cap.max_recv_wr = max_recv_wr;
	ia.cap.max_send_sge = 1;
	ia.cap.max_recv_sge = 1;
	qp = ibv_create_qp(pd, &ia);
	if (!qp)
		die(errno, "ibv_create_qp(send %u, recv %u)", max_send_wr, max_recv_wr);
	return qp;
}

/* Polls cq for one completion for at most seconds; returns 1 with *wc filled, 0 on
 * timeout. A completion with an error status is fatal, with what was being waited for. */
static inline int poll_one(struct ibv_cq *cq, struct ibv_wc *wc, double seconds, const char *what)
{
	double deadline = now_s() + seconds;
	for (;;) {
		int n = ibv_poll_cq(cq, 1, wc);
		if (n < 0)
			die(0, "ibv_poll_cq returned %d waiting for %s", n, what);
		if (n == 1) {
			if (wc->status != IBV_WC_SUCCESS)
				die(0, "%s completed with status %s (wr_id %#llx)", what,
				    ibv_wc_status_str(wc->status), (unsigned long long)wc->wr_id);
			return 1;
		}
		if (now_s() > deadline)
			return 0;
	}
}

/* Posts one request of opcode over [addr, addr+len) of mr. */
static inline void post_one(struct ibv_qp *qp, enum ibv_wr_opcode op, uint64_t wr_id, struct ibv_mr *mr,
		     void *addr, uint32_t len, uint64_t raddr, uint32_t rkey, int signaled)
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
		die(rc, "ibv_post_send(opcode %d, %u bytes, wr_id %#llx)", op, len, (unsigned long long)wr_id);
}

static inline void post_recv_one(struct ibv_qp *qp, uint64_t wr_id, struct ibv_mr *mr, void *addr, uint32_t len)
{
	struct ibv_sge sge = {.addr = (uintptr_t)addr, .length = len, .lkey = mr->lkey};
	struct ibv_recv_wr wr, *bad = NULL;
	int rc;
	memset(&wr, 0, sizeof(wr));
	wr.wr_id = wr_id;
	wr.sg_list = &sge;
	wr.num_sge = 1;
	if ((rc = ibv_post_recv(qp, &wr, &bad)))
		die(rc, "ibv_post_recv(wr_id %#llx)", (unsigned long long)wr_id);
}

#endif
