/*
 * An application whose progress must not depend on polling its send CQ. Each round it
 * posts an unsignaled 1 MiB RDMA WRITE followed by a signaled SEND on QP A, then waits for
 * the peer's reply polling only A's receive CQ (A's send and receive CQs are separate); it
 * reaps the send CQ only after the reply has come, as applications that collect send
 * completions lazily do. The peer (QP B, served by a second thread) answers every ping
 * with a SEND. Natively this completes; a shaper that releases held chunks only when the
 * application polls the send CQ never sends the ping, and the application waits for ever.
 * A's send queue is 16 deep, so a 1 MiB WRITE split into small chunks fills it.
 *
 *   hang_app [DEVICE [ROUNDS [REPLY_TIMEOUT_S]]]   (default rxe0, 5 rounds, 30 s)
 *
 * Exit status: 0 when every round got its reply, 1 when a reply did not come in time,
 * 2 on a verbs error.
 */
#include <pthread.h>

#include "common.h"

#define WRITE_LEN (1024 * 1024)
#define MSG_LEN 64
#define SQ_DEPTH 16

struct peer {
	struct ibv_qp *qp;
	struct ibv_cq *send_cq, *recv_cq;
	struct ibv_mr *mr;
	char *buf; /* the WRITE's destination, then a send and a receive slot */
	int rounds;
	volatile int pings; /* pings received so far, for the report */
};

/* The peer: answer every ping with a SEND carrying the round number. */
static void *serve(void *arg)
{
	struct peer *p = arg;
	struct ibv_wc wc;
	char *rx = p->buf + WRITE_LEN + MSG_LEN, *tx = p->buf + WRITE_LEN;
	for (int r = 0; r < p->rounds; r++) {
		if (!poll_one(p->recv_cq, &wc, 3600, "the peer's receive of a ping"))
			return NULL;
		p->pings = r + 1;
		snprintf(tx, MSG_LEN, "pong %d after %.12s", r, rx);
		post_recv_one(p->qp, 100 + r + 1, p->mr, rx, MSG_LEN);
		post_one(p->qp, IBV_WR_SEND, 200 + r, p->mr, tx, MSG_LEN, 0, 0, 1);
		if (!poll_one(p->send_cq, &wc, 60, "the peer's reply"))
			die(0, "round %d: the peer's reply SEND did not complete in 60 s", r);
	}
	return NULL;
}

int main(int argc, char **argv)
{
	const char *name = argc > 1 ? argv[1] : "rxe0";
	int rounds = argc > 2 ? atoi(argv[2]) : 5;
	double reply_timeout = argc > 3 ? atof(argv[3]) : 30;
	struct peer peer = {.rounds = rounds};
	pthread_t thread;
	struct ibv_wc wc;

	app_name = "hang_app";
	setvbuf(stdout, NULL, _IOLBF, 0);
	struct ibv_context *ctx = open_device(name);
	struct ibv_pd *pd = ibv_alloc_pd(ctx);
	if (!pd)
		die(errno, "ibv_alloc_pd");
	struct ibv_cq *a_send = ibv_create_cq(ctx, 64, NULL, NULL, 0);
	struct ibv_cq *a_recv = ibv_create_cq(ctx, 64, NULL, NULL, 0);
	peer.send_cq = ibv_create_cq(ctx, 64, NULL, NULL, 0);
	peer.recv_cq = ibv_create_cq(ctx, 64, NULL, NULL, 0);
	if (!a_send || !a_recv || !peer.send_cq || !peer.recv_cq)
		die(errno, "ibv_create_cq");
	struct ibv_qp *a = create_rc_qp(pd, a_send, a_recv, SQ_DEPTH, 4);
	peer.qp = create_rc_qp(pd, peer.send_cq, peer.recv_cq, SQ_DEPTH, 4);
	connect_qp(a, 1, 0, peer.qp->qp_num);
	connect_qp(peer.qp, 1, 0, a->qp_num);

	size_t len = WRITE_LEN + 2 * MSG_LEN;
	char *abuf = calloc(1, len);
	peer.buf = calloc(1, len);
	if (!abuf || !peer.buf)
		die(ENOMEM, "calloc");
	struct ibv_mr *amr = ibv_reg_mr(pd, abuf, len, IBV_ACCESS_LOCAL_WRITE);
	peer.mr = ibv_reg_mr(pd, peer.buf, len, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
	if (!amr || !peer.mr)
		die(errno, "ibv_reg_mr");
	post_recv_one(peer.qp, 100, peer.mr, peer.buf + WRITE_LEN + MSG_LEN, MSG_LEN);
	if ((errno = pthread_create(&thread, NULL, serve, &peer)))
		die(errno, "pthread_create");

	double start = now_s();
	for (int r = 0; r < rounds; r++) {
		memset(abuf, 'a' + r % 26, WRITE_LEN);
		post_recv_one(a, 300 + r, amr, abuf + WRITE_LEN + MSG_LEN, MSG_LEN);
		post_one(a, IBV_WR_RDMA_WRITE, 400 + r, amr, abuf, WRITE_LEN, (uintptr_t)peer.buf, peer.mr->rkey, 0);
		snprintf(abuf + WRITE_LEN, MSG_LEN, "ping %d", r);
		post_one(a, IBV_WR_SEND, 500 + r, amr, abuf + WRITE_LEN, MSG_LEN, 0, 0, 1);
		/* Only the receive CQ, as an application waiting for its peer does. */
		if (!poll_one(a_recv, &wc, reply_timeout, "the peer's reply")) {
			printf("hang_app: FAIL: round %d of %d: no reply in %.0f s while polling only the receive CQ "
			       "(the peer has received %d ping(s))\n",
			       r + 1, rounds, reply_timeout, peer.pings);
			exit(1);
		}
		if (wc.wr_id != (uint64_t)(300 + r))
			die(0, "round %d: reply completion has wr_id %llu", r, (unsigned long long)wc.wr_id);
		/* The peer saw the whole WRITE before the ping (RC ordering). */
		if (peer.buf[0] != 'a' + r % 26 || peer.buf[WRITE_LEN - 1] != 'a' + r % 26)
			die(0, "round %d: the peer's buffer does not hold the WRITE's bytes", r);
		/* Now reap the SEND's completion (lazily, after the reply). */
		if (!poll_one(a_send, &wc, 30, "A's SEND"))
			die(0, "round %d: A's signaled SEND never completed", r);
		if (wc.wr_id != (uint64_t)(500 + r))
			die(0, "round %d: A's send completion has wr_id %llu, not the SEND's", r,
			    (unsigned long long)wc.wr_id);
	}
	pthread_join(thread, NULL);
	printf("hang_app: PASS: %d rounds of a 1 MiB unsignaled WRITE + SEND, each reply awaited on the receive "
	       "CQ only, in %.2f s\n",
	       rounds, now_s() - start);
	ibv_destroy_qp(a);
	ibv_destroy_qp(peer.qp);
	ibv_dereg_mr(amr);
	ibv_dereg_mr(peer.mr);
	ibv_destroy_cq(a_send);
	ibv_destroy_cq(a_recv);
	ibv_destroy_cq(peer.send_cq);
	ibv_destroy_cq(peer.recv_cq);
	ibv_dealloc_pd(pd);
	ibv_close_device(ctx);
	return 0;
}
