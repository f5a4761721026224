/* A program that holds an RC queue pair: static_qp DEVICE SECONDS opens DEVICE, creates
 * the queue pair, says its process and number, and holds it for SECONDS. Built twice
 * (tests/vm/apps/build.sh): static_qp linked statically, rdma-core and its rxe provider
 * included, as some applications ship (no dynamic linker runs, so no preload list or
 * LD_PRELOAD reaches it), and qp_holder linked as usual. tests/vm/guest/cdi.sh expects
 * justitiad to list static_qp, and qp_holder given the unshaped device, as unshaped, and
 * qp_holder given a shaped device not. */
#include <infiniband/verbs.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

int main(int argc, char **argv) {
  if (argc != 3) {
    fprintf(stderr, "usage: static_qp DEVICE SECONDS\n");
    return 2;
  }
  int n = 0;
  struct ibv_device **list = ibv_get_device_list(&n);
  struct ibv_context *ctx = NULL;
  for (int i = 0; list && i < n && !ctx; i++)
    if (!strcmp(ibv_get_device_name(list[i]), argv[1]))
      ctx = ibv_open_device(list[i]);
  if (!ctx) {
    fprintf(stderr, "static_qp: no device %s among %d\n", argv[1], n);
    return 1;
  }
  struct ibv_pd *pd = ibv_alloc_pd(ctx);
  struct ibv_cq *cq = pd ? ibv_create_cq(ctx, 16, NULL, NULL, 0) : NULL;
  struct ibv_qp_init_attr attr = {.send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_RC,
                                  .cap = {.max_send_wr = 8, .max_recv_wr = 8, .max_send_sge = 1, .max_recv_sge = 1}};
  struct ibv_qp *qp = cq ? ibv_create_qp(pd, &attr) : NULL;
  if (!qp) {
    fprintf(stderr, "static_qp: cannot create an RC queue pair\n");
    return 1;
  }
  printf("static_qp: pid %d holds QP %u on %s\n", (int)getpid(), qp->qp_num, argv[1]);
  fflush(stdout);
  sleep((unsigned)atoi(argv[2]));
  ibv_destroy_qp(qp);
  ibv_destroy_cq(cq);
  ibv_dealloc_pd(pd);
  ibv_close_device(ctx);
  ibv_free_device_list(list);
  return 0;
}
