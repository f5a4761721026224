/*
 * A long-running rdma_cm server and a client that churns connections through it, to show
 * whether per-connection state (descriptors, memory) outlives the connections.
 *
 *   cm_churn server ADDR PORT CONNECTIONS [FD_SLACK RSS_SLACK_KB]
 *   cm_churn client ADDR PORT CONNECTIONS
 *
 * The server listens on ADDR (an IPv6 link-local address with its scope, "fe80::1%veth0",
 * works on Soft-RoCE), and for every connection request allocates a PD, a completion
 * channel, a CQ, a registered buffer and a QP (rdma_create_qp), posts a receive and accepts
 * with the buffer's address and rkey as private data. Once established it waits for the
 * client's ping, checks the bytes the client wrote, SENDs a reply, and when the client
 * disconnects frees everything. The client, one connection at a time, resolves, connects,
 * RDMA WRITEs 64 KiB (unsignaled) and SENDs a ping, waits for the reply and disconnects.
 *
 * Both print "conns=N fds=F rss_kb=R" (descriptors in /proc/self/fd, VmRSS) at 0, 5%, 25%,
 * 50%, 75% and 100% of CONNECTIONS. The server then checks that after all of them it holds
 * at most FD_SLACK (default 16) descriptors and RSS_SLACK_KB (default 4096) KiB of resident
 * memory more than after the first 5%: a per-connection leak of even one descriptor fails.
 *
 * Exit status: 0 on success, 1 when a bound is exceeded, 2 on any error (which names the
 * connection, the verb and its errno). Every wait has a deadline (10 s).
 */
#include <netdb.h>
#include <poll.h>
#include <dirent.h>

#include <rdma/rdma_cma.h>

#include "common.h"

#define WRITE_LEN (64 * 1024)
#define MSG_LEN 64
#define WAIT_S 10

/* What the server tells the client in its accept: where to WRITE. */
struct target {
	uint64_t addr;
	uint32_t rkey;
} __attribute__((packed));

static const char *role = "?";
static int served;
/* The client's time in each phase of a connection, summed, for the report: where the
 * time of a churn goes (under emulation it is mostly the connection handshake). */
enum phase { RESOLVE, CONNECT, EXCHANGE, DISCONNECT, TEARDOWN, PHASES };
static double phase_s[PHASES];
static const char *phase_name[PHASES] = {"resolve", "connect", "exchange", "disconnect", "teardown"};

static long open_fds(void)
{
	long n = 0;
	DIR *d = opendir("/proc/self/fd");
	struct dirent *e;
	if (!d)
		return -1;
	while ((e = readdir(d)))
		if (e->d_name[0] != '.')
			n++;
	closedir(d);
	return n - 1; /* the directory stream's own descriptor */
}

static long rss_kb(void)
{
	char line[256];
	long kb = -1;
	FILE *f = fopen("/proc/self/status", "r");
	if (!f)
		return -1;
	while (fgets(line, sizeof(line), f))
		if (sscanf(line, "VmRSS: %ld kB", &kb) == 1)
			break;
	fclose(f);
	return kb;
}

static void report(int conns, long *fds, long *rss)
{
	long f = open_fds(), r = rss_kb();
	printf("cm_churn %s: conns=%d fds=%ld rss_kb=%ld", role, conns, f, r);
	if (!strcmp(role, "client") && conns > 0) {
		printf(" seconds:");
		for (int p = 0; p < PHASES; p++)
			printf(" %s=%.1f", phase_name[p], phase_s[p]);
	}
	printf("\n");
	if (fds)
		*fds = f;
	if (rss)
		*rss = r;
}

/* On any exit, where it stood: a failure after many connections shows the counts. */
static void at_exit(void)
{
	printf("cm_churn %s: at exit: conns=%d fds=%ld rss_kb=%ld\n", role, served, open_fds(), rss_kb());
}

static int is_checkpoint(int conns, int total)
{
	return conns == 0 || conns == total / 20 || conns == total / 4 || conns == total / 2 ||
	       conns == 3 * total / 4 || conns == total;
}

/* Fills the WRITE area with a pattern that depends on the connection's number. */
static void fill(char *p, int conn)
{
	for (int i = 0; i < WRITE_LEN; i++)
		p[i] = (char)(i * 31 + conn);
}

static int check_fill(const char *p, int conn)
{
	for (int i = 0; i < WRITE_LEN; i++)
		if (p[i] != (char)(i * 31 + conn))
			return i;
	return -1;
}

/* The next event, within WAIT_S seconds; dies on timeout. The caller acks it. */
static struct rdma_cm_event *next_event(struct rdma_event_channel *ec, const char *waiting_for)
{
	struct pollfd pfd = {.fd = ec->fd, .events = POLLIN};
	struct rdma_cm_event *ev;
	int rc = poll(&pfd, 1, WAIT_S * 1000);
	if (rc == 0)
		die(0, "connection %d: no rdma_cm event in %d s waiting for %s", served, WAIT_S, waiting_for);
	if (rc < 0)
		die(errno, "poll on the event channel");
	if (rdma_get_cm_event(ec, &ev))
		die(errno, "connection %d: rdma_get_cm_event waiting for %s", served, waiting_for);
	return ev;
}

/* Waits for an event of type; copies the private data of an ESTABLISHED event. */
static void expect_event(struct rdma_event_channel *ec, enum rdma_cm_event_type type, struct target *pd_out)
{
	struct rdma_cm_event *ev = next_event(ec, rdma_event_str(type));
	if (ev->event != type)
		die(0, "connection %d: got %s (status %d) waiting for %s", served, rdma_event_str(ev->event),
		    ev->status, rdma_event_str(type));
	if (pd_out) {
		if (!ev->param.conn.private_data || ev->param.conn.private_data_len < sizeof(*pd_out))
			die(0, "connection %d: the accept carried no target", served);
		memcpy(pd_out, ev->param.conn.private_data, sizeof(*pd_out));
	}
	rdma_ack_cm_event(ev);
}

static struct addrinfo *resolve(const char *addr, const char *port, int passive)
{
	struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_flags = AI_NUMERICHOST | (passive ? AI_PASSIVE : 0)};
	struct addrinfo *ai;
	int rc = getaddrinfo(addr, port, &hints, &ai);
	if (rc)
		die(0, "getaddrinfo(%s, %s): %s", addr, port, gai_strerror(rc));
	return ai;
}

/* One accepted connection's resources. */
struct conn {
	struct ibv_pd *pd;
	struct ibv_comp_channel *channel;
	struct ibv_cq *cq;
	struct ibv_mr *mr;
	char *buf; /* the WRITE area, then a send and a receive slot */
};

static struct conn *accept_one(struct rdma_cm_id *id)
{
	struct conn *c = calloc(1, sizeof(*c));
	struct ibv_qp_init_attr ia;
	struct target t;
	struct rdma_conn_param param;
	if (!c)
		die(ENOMEM, "calloc");
	if (!(c->pd = ibv_alloc_pd(id->verbs)))
		die(errno, "connection %d: ibv_alloc_pd", served);
	if (!(c->channel = ibv_create_comp_channel(id->verbs)))
		die(errno, "connection %d: ibv_create_comp_channel", served);
	if (!(c->cq = ibv_create_cq(id->verbs, 16, NULL, c->channel, 0)))
		die(errno, "connection %d: ibv_create_cq", served);
	if (!(c->buf = calloc(1, WRITE_LEN + 2 * MSG_LEN)))
		die(ENOMEM, "calloc");
	c->mr = ibv_reg_mr(c->pd, c->buf, WRITE_LEN + 2 * MSG_LEN, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
	if (!c->mr)
		die(errno, "connection %d: ibv_reg_mr", served);
	memset(&ia, 0, sizeof(ia));
	ia.send_cq = ia.recv_cq = c->cq;
	ia.qp_type = IBV_QPT_RC;
	ia.cap.max_send_wr = 16;
	ia.cap.max_recv_wr = 4;
	ia.cap.max_send_sge = ia.cap.max_recv_sge = 1;
	if (rdma_create_qp(id, c->pd, &ia))
		die(errno, "connection %d: rdma_create_qp", served);
	post_recv_one(id->qp, 1, c->mr, c->buf + WRITE_LEN + MSG_LEN, MSG_LEN);
	t.addr = (uintptr_t)c->buf;
	t.rkey = c->mr->rkey;
	memset(&param, 0, sizeof(param));
	param.private_data = &t;
	param.private_data_len = sizeof(t);
	param.responder_resources = 1;
	param.initiator_depth = 1;
	param.rnr_retry_count = 7;
	if (rdma_accept(id, &param))
		die(errno, "connection %d: rdma_accept", served);
	id->context = c;
	return c;
}

/* The established connection's exchange: the ping, the written bytes, the reply. */
static void serve_one(struct rdma_cm_id *id, struct conn *c)
{
	struct ibv_wc wc;
	int conn = -1, bad;
	if (!poll_one(c->cq, &wc, WAIT_S, "the client's ping"))
		die(0, "connection %d: no ping in %d s", served, WAIT_S);
	if (sscanf(c->buf + WRITE_LEN + MSG_LEN, "ping %d", &conn) != 1)
		die(0, "connection %d: the ping is garbled", served);
	bad = check_fill(c->buf, conn);
	snprintf(c->buf + WRITE_LEN, MSG_LEN, "%s %d", bad < 0 ? "ok" : "bad", conn);
	/* The reply's own completion is not awaited: the client disconnects as soon as the
	 * reply lands, possibly before its acknowledgement reaches this side, and then the
	 * SEND completes with an error status or not at all. release() drains the CQ. */
	post_one(id->qp, IBV_WR_SEND, 2, c->mr, c->buf + WRITE_LEN, MSG_LEN, 0, 0, 1);
	if (bad >= 0)
		die(0, "connection %d: the client's WRITE differs at byte %d", conn, bad);
}

static void release(struct rdma_cm_id *id)
{
	struct conn *c = id->context;
	struct ibv_wc wc[4];
	while (ibv_poll_cq(c->cq, 4, wc) > 0)
		; /* the reply's completion, whatever its status */
	rdma_destroy_qp(id);
	if (ibv_dereg_mr(c->mr) || ibv_destroy_cq(c->cq) || ibv_destroy_comp_channel(c->channel) ||
	    ibv_dealloc_pd(c->pd))
		die(errno, "connection %d: freeing its verbs objects", served);
	free(c->buf);
	free(c);
	if (rdma_destroy_id(id))
		die(errno, "connection %d: rdma_destroy_id", served);
}

static int server(const char *addr, const char *port, int total, long fd_slack, long rss_slack)
{
	struct rdma_event_channel *ec = rdma_create_event_channel();
	struct rdma_cm_id *listener;
	struct addrinfo *ai = resolve(addr, port, 1);
	long fds[2] = {0, 0}, rss[2] = {0, 0};
	if (!ec)
		die(errno, "rdma_create_event_channel");
	if (rdma_create_id(ec, &listener, NULL, RDMA_PS_TCP))
		die(errno, "rdma_create_id");
	if (rdma_bind_addr(listener, ai->ai_addr))
		die(errno, "rdma_bind_addr(%s)", addr);
	freeaddrinfo(ai);
	if (rdma_listen(listener, 8))
		die(errno, "rdma_listen");
	report(0, NULL, NULL);
	while (served < total) {
		struct rdma_cm_event *ev = next_event(ec, "a connection event");
		struct rdma_cm_id *id = ev->id;
		enum rdma_cm_event_type type = ev->event;
		switch (type) {
		case RDMA_CM_EVENT_CONNECT_REQUEST:
			rdma_ack_cm_event(ev);
			accept_one(id);
			break;
		case RDMA_CM_EVENT_ESTABLISHED:
			rdma_ack_cm_event(ev);
			serve_one(id, id->context);
			break;
		case RDMA_CM_EVENT_DISCONNECTED:
			rdma_ack_cm_event(ev);
			rdma_disconnect(id); /* completes the handshake; harmless if already done */
			release(id);
			served++;
			if (served == total / 20)
				report(served, &fds[0], &rss[0]);
			else if (served == total)
				report(served, &fds[1], &rss[1]);
			else if (is_checkpoint(served, total))
				report(served, NULL, NULL);
			break;
		default:
			die(0, "connection %d: unexpected event %s (status %d)", served, rdma_event_str(type), ev->status);
		}
	}
	rdma_destroy_id(listener);
	rdma_destroy_event_channel(ec);
	int ok = fds[1] - fds[0] <= fd_slack && rss[1] - rss[0] <= rss_slack;
	printf("cm_churn server: %s: after %d connections fds %ld -> %ld (+%ld, bound +%ld), rss %ld -> %ld kB "
	       "(+%ld, bound +%ld) since connection %d\n",
	       ok ? "PASS" : "FAIL", total, fds[0], fds[1], fds[1] - fds[0], fd_slack, rss[0], rss[1],
	       rss[1] - rss[0], rss_slack, total / 20);
	return ok ? 0 : 1;
}

static void client_one(struct rdma_event_channel *ec, struct addrinfo *ai, int conn)
{
	struct rdma_cm_id *id;
	struct ibv_qp_init_attr ia;
	struct rdma_conn_param param;
	struct target target;
	struct ibv_wc wc;
	char *buf = calloc(1, WRITE_LEN + 2 * MSG_LEN);
	if (!buf)
		die(ENOMEM, "calloc");
	double t = now_s(), t2;
#define PHASE(p) (t2 = now_s(), phase_s[p] += t2 - t, t = t2)
	if (rdma_create_id(ec, &id, NULL, RDMA_PS_TCP))
		die(errno, "connection %d: rdma_create_id", conn);
	if (rdma_resolve_addr(id, NULL, ai->ai_addr, WAIT_S * 1000))
		die(errno, "connection %d: rdma_resolve_addr", conn);
	expect_event(ec, RDMA_CM_EVENT_ADDR_RESOLVED, NULL);
	if (rdma_resolve_route(id, WAIT_S * 1000))
		die(errno, "connection %d: rdma_resolve_route", conn);
	expect_event(ec, RDMA_CM_EVENT_ROUTE_RESOLVED, NULL);
	PHASE(RESOLVE);
	struct ibv_pd *pd = ibv_alloc_pd(id->verbs);
	if (!pd)
		die(errno, "connection %d: ibv_alloc_pd", conn);
	struct ibv_cq *cq = ibv_create_cq(id->verbs, 16, NULL, NULL, 0);
	if (!cq)
		die(errno, "connection %d: ibv_create_cq", conn);
	struct ibv_mr *mr = ibv_reg_mr(pd, buf, WRITE_LEN + 2 * MSG_LEN, IBV_ACCESS_LOCAL_WRITE);
	if (!mr)
		die(errno, "connection %d: ibv_reg_mr", conn);
	memset(&ia, 0, sizeof(ia));
	ia.send_cq = ia.recv_cq = cq;
	ia.qp_type = IBV_QPT_RC;
	ia.cap.max_send_wr = 16;
	ia.cap.max_recv_wr = 4;
	ia.cap.max_send_sge = ia.cap.max_recv_sge = 1;
	if (rdma_create_qp(id, pd, &ia))
		die(errno, "connection %d: rdma_create_qp", conn);
	post_recv_one(id->qp, 1, mr, buf + WRITE_LEN + MSG_LEN, MSG_LEN);
	memset(&param, 0, sizeof(param));
	param.responder_resources = 1;
	param.initiator_depth = 1;
	param.retry_count = 7;
	param.rnr_retry_count = 7;
	if (rdma_connect(id, &param))
		die(errno, "connection %d: rdma_connect", conn);
	expect_event(ec, RDMA_CM_EVENT_ESTABLISHED, &target);
	PHASE(CONNECT);

	fill(buf, conn);
	post_one(id->qp, IBV_WR_RDMA_WRITE, 2, mr, buf, WRITE_LEN, target.addr, target.rkey, 0);
	snprintf(buf + WRITE_LEN, MSG_LEN, "ping %d", conn);
	post_one(id->qp, IBV_WR_SEND, 3, mr, buf + WRITE_LEN, MSG_LEN, 0, 0, 1);
	/* The SEND's completion and the reply, in either order. */
	int got_send = 0, got_reply = 0;
	while (!got_send || !got_reply) {
		if (!poll_one(cq, &wc, WAIT_S, "the SEND's completion or the reply"))
			die(0, "connection %d: %s in %d s", conn, got_send ? "no reply" : "the SEND did not complete",
			    WAIT_S);
		if (wc.wr_id == 3)
			got_send = 1;
		else if (wc.wr_id == 1)
			got_reply = 1;
		else
			die(0, "connection %d: a completion with wr_id %llu", conn, (unsigned long long)wc.wr_id);
	}
	char expect[MSG_LEN];
	snprintf(expect, sizeof(expect), "ok %d", conn);
	if (strcmp(buf + WRITE_LEN + MSG_LEN, expect) != 0)
		die(0, "connection %d: the server replied \"%.20s\", not \"%s\"", conn, buf + WRITE_LEN + MSG_LEN,
		    expect);
	PHASE(EXCHANGE);
	if (rdma_disconnect(id))
		die(errno, "connection %d: rdma_disconnect", conn);
	expect_event(ec, RDMA_CM_EVENT_DISCONNECTED, NULL);
	PHASE(DISCONNECT);
	rdma_destroy_qp(id);
	if (ibv_dereg_mr(mr) || ibv_destroy_cq(cq) || ibv_dealloc_pd(pd))
		die(errno, "connection %d: freeing its verbs objects", conn);
	if (rdma_destroy_id(id))
		die(errno, "connection %d: rdma_destroy_id", conn);
	free(buf);
	PHASE(TEARDOWN);
#undef PHASE
}

static int client(const char *addr, const char *port, int total)
{
	struct rdma_event_channel *ec = rdma_create_event_channel();
	struct addrinfo *ai = resolve(addr, port, 0);
	double start = now_s();
	if (!ec)
		die(errno, "rdma_create_event_channel");
	report(0, NULL, NULL);
	for (served = 0; served < total;) {
		client_one(ec, ai, served);
		served++;
		if (is_checkpoint(served, total))
			report(served, NULL, NULL);
	}
	freeaddrinfo(ai);
	rdma_destroy_event_channel(ec);
	printf("cm_churn client: PASS: %d connections opened, used and closed in %.1f s\n", total, now_s() - start);
	return 0;
}

int main(int argc, char **argv)
{
	app_name = "cm_churn";
	setvbuf(stdout, NULL, _IOLBF, 0);
	if (argc < 5 || (strcmp(argv[1], "server") && strcmp(argv[1], "client"))) {
		fprintf(stderr, "usage: cm_churn server|client ADDR PORT CONNECTIONS [FD_SLACK RSS_SLACK_KB]\n");
		return 2;
	}
	role = argv[1];
	int total = atoi(argv[4]);
	if (total < 20)
		die(0, "CONNECTIONS must be at least 20, not %s", argv[4]);
	atexit(at_exit);
	if (!strcmp(role, "server"))
		return server(argv[2], argv[3], total, argc > 5 ? atol(argv[5]) : 16, argc > 6 ? atol(argv[6]) : 4096);
	return client(argv[2], argv[3], total);
}
