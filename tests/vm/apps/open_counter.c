/* An interposer of the kind images preload themselves (an allocator, a profiler, a tracer):
 * libopen_counter.so wraps ibv_open_device, counts its calls and passes each on to the next
 * definition in the search order (RTLD_NEXT), and at exit writes the count to the file
 * named by OPEN_COUNTER_FILE. tests/vm/guest/cdi.sh preloads it with the image's own
 * LD_PRELOAD while the CDI spec injects the shaper: a count above zero beside the shaper's
 * statistics shows both loaded, this one still interposing, and the call reaching the
 * shaper and libibverbs through it. Built for musl too (libopen_counter.musl.so), where the
 * musl image preloads it and the precreate hook adds the shaper's musl build after it. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>

struct ibv_device;
struct ibv_context;

static atomic_int calls;

__attribute__((visibility("default"))) struct ibv_context *ibv_open_device(struct ibv_device *device) {
  static struct ibv_context *(*next)(struct ibv_device *);
  if (!next)
    next = (struct ibv_context * (*)(struct ibv_device *)) dlsym(RTLD_NEXT, "ibv_open_device");
  atomic_fetch_add(&calls, 1);
  return next ? next(device) : NULL;
}

__attribute__((destructor)) static void report(void) {
  const char *path = getenv("OPEN_COUNTER_FILE");
  FILE *out = path ? fopen(path, "w") : NULL;
  if (!out)
    return;
  fprintf(out, "ibv_open_device calls: %d\n", atomic_load(&calls));
  fclose(out);
}
