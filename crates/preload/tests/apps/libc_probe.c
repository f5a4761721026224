/* A program as containers run them, for the portable builds' load tests
 * (tests/portable.rs) and the guest's container checks (tests/vm/guest/cdi.sh): it starts
 * a thread, forks and waits for its child, and looks for libibverbs with dlopen as NCCL
 * and UCX do, each of which runs through the preloaded shaper's hooks (its fork handlers,
 * its dlsym). Without libibverbs (a musl image has none that a glibc build could use) it
 * says so and exits 0, as it does without the shaper. It also says whether a libjustitia
 * is mapped into it (from /proc/self/maps), which is how a check sees the shaper loaded
 * into a program that opens no device. */
#include <dlfcn.h>
#include <string.h>
#include <pthread.h>
#include <stdio.h>
#include <sys/wait.h>
#include <unistd.h>

static void *worker(void *arg) {
  *(int *)arg = 42;
  return NULL;
}

/* Whether a mapping of a file named libjustitia.so is in this process. */
static int shaper_mapped(void) {
  FILE *maps = fopen("/proc/self/maps", "r");
  char line[4096];
  int found = 0;
  if (!maps)
    return 0;
  while (!found && fgets(line, sizeof line, maps))
    found = strstr(line, "/libjustitia.so") != NULL;
  fclose(maps);
  return found;
}

int main(void) {
  int value = 0;
  pthread_t thread;
  if (pthread_create(&thread, NULL, worker, &value) != 0 || pthread_join(thread, NULL) != 0) {
    fprintf(stderr, "libc_probe: thread failed\n");
    return 1;
  }
  pid_t child = fork();
  if (child == 0)
    _exit(value == 42 ? 0 : 1);
  int status = 0;
  if (child < 0 || waitpid(child, &status, 0) != child || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    fprintf(stderr, "libc_probe: fork failed\n");
    return 1;
  }
  void *verbs = dlopen("libibverbs.so.1", RTLD_NOW);
  void *open_device = verbs ? dlsym(verbs, "ibv_open_device") : NULL;
  printf("libc_probe: thread, fork, libibverbs %s, shaper %s\n", open_device ? "found" : "absent",
         shaper_mapped() ? "mapped" : "not mapped");
  return 0;
}
