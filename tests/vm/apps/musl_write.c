/* A loopback RDMA WRITE that checks its bytes: musl_write DEVICE [BYTES [ROUNDS [GID_INDEX]]]
 * opens DEVICE, connects two RC queue pairs on its port 1 to each other (rxe loops the
 * traffic back), and ROUNDS times (4 by default) writes BYTES (16 KiB by default) of a
 * pattern that changes each round from one QP's buffer into the other's, waits for the
 * completion and compares the destination with the source. Prints one line and exits 0
 * when every byte arrived, 1 on a mismatch, 2 on an error.
 *
 * Built with musl-gcc against a musl build of rdma-core (tests/vm/apps/build-musl-verbs.sh)
 * for the musl image of tests/vm/guest/cdi.sh, where it runs with and without the shaper's
 * musl build in LD_PRELOAD. Nothing in it is specific to musl. */
#include "common.h"

#include <unistd.h>

int main(int argc, char **argv)
{
	app_name = "musl_write";
	if (argc < 2 || argc > 5) {
		fprintf(stderr, "usage: musl_write DEVICE [BYTES [ROUNDS [GID_INDEX]]]\n");
		return 2;
	}
	uint32_t bytes = argc > 2 ? (uint32_t)strtoul(argv[2], NULL, 0) : 16384;
	int rounds = argc > 3 ? atoi(argv[3]) : 4;
	int gid_index = argc > 4 ? atoi(argv[4]) : 0;
	if (bytes == 0 || rounds <= 0)
		die(0, "BYTES and ROUNDS must be positive");

	struct ibv_context *ctx = open_device(argv[1]);
	struct ibv_pd *pd = ibv_alloc_pd(ctx);
	if (!pd)
		die(errno, "ibv_alloc_pd");
	struct ibv_cq *cq = ibv_create_cq(ctx, 64, NULL, NULL, 0);
	if (!cq)
		die(errno, "ibv_create_cq");
	struct ibv_qp *a = create_rc_qp(pd, cq, cq, 8, 8);
	struct ibv_qp *b = create_rc_qp(pd, cq, cq, 8, 8);
	connect_qp(a, 1, gid_index, b->qp_num);
	connect_qp(b, 1, gid_index, a->qp_num);

	unsigned char *src = malloc(bytes), *dst = malloc(bytes);
	if (!src || !dst)
		die(errno, "malloc(%u)", bytes);
	int access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;
	struct ibv_mr *smr = ibv_reg_mr(pd, src, bytes, access);
	struct ibv_mr *dmr = smr ? ibv_reg_mr(pd, dst, bytes, access) : NULL;
	if (!dmr)
		die(errno, "ibv_reg_mr(%u bytes)", bytes);

	for (int r = 0; r < rounds; r++) {
		for (uint32_t i = 0; i < bytes; i++)
			src[i] = (unsigned char)(i * 31 + (uint32_t)r * 7 + 1);
		memset(dst, 0, bytes);
		post_one(a, IBV_WR_RDMA_WRITE, (uint64_t)r, smr, src, bytes, (uint64_t)(uintptr_t)dst, dmr->rkey, 1);
		struct ibv_wc wc;
		if (!poll_one(cq, &wc, 30, "the RDMA WRITE"))
			die(0, "round %d: no completion within 30 s", r);
		if (wc.opcode != IBV_WC_RDMA_WRITE || wc.wr_id != (uint64_t)r)
			die(0, "round %d: a completion of opcode %d, wr_id %llu", r, wc.opcode,
			    (unsigned long long)wc.wr_id);
		for (uint32_t i = 0; i < bytes; i++) {
			if (dst[i] != src[i]) {
				fprintf(stderr, "musl_write: round %d: byte %u is %#x, written %#x\n", r, i, dst[i],
					src[i]);
				return 1;
			}
		}
	}
	printf("musl_write: pid %d wrote %d x %u bytes from QP %u to QP %u on %s, every byte checked\n",
	       (int)getpid(), rounds, bytes, a->qp_num, b->qp_num, argv[1]);

	ibv_dereg_mr(dmr);
	ibv_dereg_mr(smr);
	ibv_destroy_qp(b);
	ibv_destroy_qp(a);
	ibv_destroy_cq(cq);
	ibv_dealloc_pd(pd);
	ibv_close_device(ctx);
	free(src);
	free(dst);
	return 0;
}
