/*
 * A control-verb application, as Husky's control-verb attackers and an ordinary
 * application's set-up both are: ctl_storm DEVICE reg|reg-dlvsym|qp|modify SECONDS
 * [INTERVAL_US].
 *
 * For SECONDS it registers (reg: ibv_reg_mr of a 4 KiB buffer, then ibv_dereg_mr;
 * reg-dlvsym: the same through ibv_reg_mr_iova2, looked up as NCCL's verbs wrapper does,
 * with dlvsym(dlopen("libibverbs.so.1"), "ibv_reg_mr_iova2", "IBVERBS_1.8")), creates
 * (qp: ibv_create_qp of an RC QP, then ibv_destroy_qp) or brings one RC QP up again and
 * again (modify: to RESET, then INIT, RTR and RTS, connected to itself on GID index
 * CTL_STORM_GID, default 0), back to back with INTERVAL_US 0 (the storm, the default) or
 * one every INTERVAL_US (an application registering now and then). Each verb's (or
 * cycle's) own time is a sample. It prints one line:
 *   {"verb":"reg","count":N,"seconds":S,"per_sec":R,"p50_us":A,"p99_us":B,"max_us":C}
 * Exit 0 after the time, 2 on any verb's failure.
 */
#define _GNU_SOURCE /* dlvsym */
#include "common.h"

#include <dlfcn.h>
#include <unistd.h>

#define MAX_SAMPLES 1000000

static int cmp_double(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;
	return (x > y) - (x < y);
}

int main(int argc, char **argv)
{
	app_name = "ctl_storm";
	const char *mode = argc > 2 ? argv[2] : "";
	int reg = strcmp(mode, "reg") == 0, reg_dlvsym = strcmp(mode, "reg-dlvsym") == 0;
	int modify = strcmp(mode, "modify") == 0;
	if (argc < 4 || !(reg || reg_dlvsym || modify || strcmp(mode, "qp") == 0))
		die(0, "usage: ctl_storm DEVICE reg|reg-dlvsym|qp|modify SECONDS [INTERVAL_US]");
	double seconds = atof(argv[3]);
	long interval_us = argc > 4 ? atol(argv[4]) : 0;
	if (seconds <= 0 || interval_us < 0)
		die(0, "SECONDS must be positive and INTERVAL_US not negative");
	struct ibv_context *ctx = open_device(argv[1]);
	struct ibv_pd *pd = ibv_alloc_pd(ctx);
	if (!pd)
		die(errno, "ibv_alloc_pd");
	struct ibv_cq *cq = ibv_create_cq(ctx, 4, NULL, NULL, 0);
	if (!cq)
		die(errno, "ibv_create_cq");
	typedef struct ibv_mr *(*reg_mr_iova2_fn)(struct ibv_pd *, void *, size_t, uint64_t, unsigned int);
	reg_mr_iova2_fn reg_mr_iova2 = NULL;
	if (reg_dlvsym) {
		void *verbs = dlopen("libibverbs.so.1", RTLD_NOW);
		if (!verbs)
			die(0, "dlopen(libibverbs.so.1): %s", dlerror());
		reg_mr_iova2 = (reg_mr_iova2_fn)dlvsym(verbs, "ibv_reg_mr_iova2", "IBVERBS_1.8");
		if (!reg_mr_iova2)
			die(0, "dlvsym(ibv_reg_mr_iova2, IBVERBS_1.8): %s", dlerror());
	}
	struct ibv_qp *cycled = NULL;
	int gid_index = getenv("CTL_STORM_GID") ? atoi(getenv("CTL_STORM_GID")) : 0;
	if (modify) {
		struct ibv_qp_init_attr attr = {
			.send_cq = cq,
			.recv_cq = cq,
			.qp_type = IBV_QPT_RC,
			.cap = { .max_send_wr = 1, .max_recv_wr = 1, .max_send_sge = 1, .max_recv_sge = 1 },
		};
		cycled = ibv_create_qp(pd, &attr);
		if (!cycled)
			die(errno, "ibv_create_qp");
	}
	static char buf[4096];
	double *samples = calloc(MAX_SAMPLES, sizeof(double));
	if (!samples)
		die(errno, "calloc");
	long n = 0;
	double start = now_s(), end = start + seconds;
	while (now_s() < end && n < MAX_SAMPLES) {
		double t0 = now_s();
		if (reg || reg_dlvsym) {
			struct ibv_mr *mr = reg ? ibv_reg_mr(pd, buf, sizeof(buf), IBV_ACCESS_LOCAL_WRITE)
						: reg_mr_iova2(pd, buf, sizeof(buf), (uintptr_t)buf,
							       IBV_ACCESS_LOCAL_WRITE);
			if (!mr)
				die(errno, "%s (verb %ld)", reg ? "ibv_reg_mr" : "ibv_reg_mr_iova2", n);
			samples[n++] = now_s() - t0;
			if (ibv_dereg_mr(mr))
				die(errno, "ibv_dereg_mr (verb %ld)", n);
		} else if (modify) {
			struct ibv_qp_attr a = { .qp_state = IBV_QPS_RESET };
			int rc = ibv_modify_qp(cycled, &a, IBV_QP_STATE);
			if (rc)
				die(rc, "ibv_modify_qp(RESET) (cycle %ld)", n);
			connect_qp(cycled, 1, gid_index, cycled->qp_num);
			samples[n++] = now_s() - t0;
		} else {
			struct ibv_qp_init_attr attr = {
				.send_cq = cq,
				.recv_cq = cq,
				.qp_type = IBV_QPT_RC,
				.cap = { .max_send_wr = 1, .max_recv_wr = 1, .max_send_sge = 1, .max_recv_sge = 1 },
			};
			struct ibv_qp *qp = ibv_create_qp(pd, &attr);
			if (!qp)
				die(errno, "ibv_create_qp (verb %ld)", n);
			samples[n++] = now_s() - t0;
			if (ibv_destroy_qp(qp))
				die(errno, "ibv_destroy_qp (verb %ld)", n);
		}
		if (interval_us > 0)
			usleep((useconds_t)interval_us);
	}
	double took = now_s() - start;
	qsort(samples, (size_t)n, sizeof(double), cmp_double);
	double p50 = n ? samples[n / 2] : 0, p99 = n ? samples[(n * 99) / 100] : 0;
	double max = n ? samples[n - 1] : 0;
	printf("{\"verb\":\"%s\",\"count\":%ld,\"seconds\":%.3f,\"per_sec\":%.1f,"
	       "\"p50_us\":%.1f,\"p99_us\":%.1f,\"max_us\":%.1f}\n",
	       mode, n, took, n / took, p50 * 1e6, p99 * 1e6, max * 1e6);
	free(samples);
	if (cycled && ibv_destroy_qp(cycled))
		die(errno, "ibv_destroy_qp");
	ibv_destroy_cq(cq);
	ibv_dealloc_pd(pd);
	ibv_close_device(ctx);
	return 0;
}
