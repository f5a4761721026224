/*
 * Destroys queue pairs that still have work outstanding, while another thread polls the
 * CQ they complete into. Each iteration creates two RC QPs on one device, connects them,
 * posts several 1 MiB RDMA WRITEs on A and destroys A at once (after moving it to the
 * error state in even iterations, directly in odd ones, after a short pause in some), then
 * B. Under a slow pace the shaper still holds most of those WRITEs' chunks when A goes;
 * nothing may then touch A (its provider object is freed). Meant to run under valgrind's
 * memcheck, which sees a read of freed memory in any library of the process.
 *
 *   destroy_held [DEVICE [ITERATIONS [WRITES]]]   (default rxe0, 200, 4)
 *
 * Exit status: 0 when every iteration ran, 2 on a verbs error.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <unistd.h>

#include "common.h"

#define WRITE_LEN (1024 * 1024)

struct poller {
	struct ibv_cq *cqs[2];
	atomic_int stop;
	long ok, flushed, other;
};

/* Polls both CQs until told to stop, counting completions by status. */
static void *poll_cqs(void *arg)
{
	struct poller *p = arg;
	struct ibv_wc wc[16];
	while (!atomic_load(&p->stop)) {
		for (int c = 0; c < 2; c++) {
			int n = ibv_poll_cq(p->cqs[c], 16, wc);
			if (n < 0)
				die(0, "ibv_poll_cq returned %d", n);
			for (int i = 0; i < n; i++) {
				if (wc[i].status == IBV_WC_SUCCESS)
					p->ok++;
				else if (wc[i].status == IBV_WC_WR_FLUSH_ERR)
					p->flushed++;
				else
					p->other++;
			}
		}
		sched_yield();
	}
	return NULL;
}

int main(int argc, char **argv)
{
	const char *name = argc > 1 ? argv[1] : "rxe0";
	int iterations = argc > 2 ? atoi(argv[2]) : 200;
	int writes = argc > 3 ? atoi(argv[3]) : 4;
	struct poller poller = {0};
	pthread_t thread;
	int rc;

	app_name = "destroy_held";
	setvbuf(stdout, NULL, _IOLBF, 0);
	if (writes < 1 || writes > 16)
		die(0, "WRITES must be 1 to 16, not %d", writes);
	struct ibv_context *ctx = open_device(name);
	struct ibv_pd *pd = ibv_alloc_pd(ctx);
	if (!pd)
		die(errno, "ibv_alloc_pd");
	/* Deep enough for every iteration's flushes even if the poller falls behind. */
	struct ibv_cq *send_cq = ibv_create_cq(ctx, 4096, NULL, NULL, 0);
	struct ibv_cq *recv_cq = ibv_create_cq(ctx, 256, NULL, NULL, 0);
	if (!send_cq || !recv_cq)
		die(errno, "ibv_create_cq");
	char *src = calloc(1, WRITE_LEN), *dst = calloc(1, WRITE_LEN);
	if (!src || !dst)
		die(ENOMEM, "calloc");
	struct ibv_mr *smr = ibv_reg_mr(pd, src, WRITE_LEN, IBV_ACCESS_LOCAL_WRITE);
	struct ibv_mr *dmr = ibv_reg_mr(pd, dst, WRITE_LEN, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
	if (!smr || !dmr)
		die(errno, "ibv_reg_mr");

	poller.cqs[0] = send_cq;
	poller.cqs[1] = recv_cq;
	if ((rc = pthread_create(&thread, NULL, poll_cqs, &poller)))
		die(rc, "pthread_create");

	double start = now_s();
	int to_error = 0;
	for (int it = 0; it < iterations; it++) {
		struct ibv_qp *a = create_rc_qp(pd, send_cq, recv_cq, 64, 4);
		struct ibv_qp *b = create_rc_qp(pd, send_cq, recv_cq, 64, 4);
		connect_qp(a, 1, 0, b->qp_num);
		connect_qp(b, 1, 0, a->qp_num);
		for (int w = 0; w < writes; w++)
			post_one(a, IBV_WR_RDMA_WRITE, ((uint64_t)it << 8) | (uint64_t)w, smr, src, WRITE_LEN,
				 (uintptr_t)dst, dmr->rkey, w == writes - 1 || w % 2 == 0);
		/* Vary the moment: at once, or while chunks are being released. */
		if (it % 3 == 1)
			usleep(2000);
		else if (it % 3 == 2)
			usleep(20000);
		if (it % 2 == 0) {
			struct ibv_qp_attr attr = {.qp_state = IBV_QPS_ERR};
			if ((rc = ibv_modify_qp(a, &attr, IBV_QP_STATE)))
				die(rc, "iteration %d: ibv_modify_qp(ERR)", it);
			to_error++;
		}
		if ((rc = ibv_destroy_qp(a)))
			die(rc, "iteration %d: ibv_destroy_qp(A) with %d WRITEs posted", it, writes);
		if ((rc = ibv_destroy_qp(b)))
			die(rc, "iteration %d: ibv_destroy_qp(B)", it);
		if ((it + 1) % 50 == 0)
			printf("destroy_held: %d iterations in %.1f s\n", it + 1, now_s() - start);
	}
	atomic_store(&poller.stop, 1);
	pthread_join(thread, NULL);
	printf("destroy_held: PASS: %d iterations (%d through the error state), %d x 1 MiB WRITEs each, "
	       "QP A destroyed with them outstanding; poller saw %ld successful, %ld flushed, %ld other "
	       "completions; %.1f s\n",
	       iterations, to_error, writes, poller.ok, poller.flushed, poller.other, now_s() - start);
	ibv_dereg_mr(smr);
	ibv_dereg_mr(dmr);
	ibv_destroy_cq(send_cq);
	ibv_destroy_cq(recv_cq);
	ibv_dealloc_pd(pd);
	ibv_close_device(ctx);
	free(src);
	free(dst);
	return 0;
}
