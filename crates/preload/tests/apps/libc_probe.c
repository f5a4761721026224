/* A program as containers run them, for the portable builds' load tests
 * (tests/portable.rs): it starts a thread, forks and waits for its child, and looks for
 * libibverbs with dlopen as NCCL and UCX do, each of which runs through the preloaded
 * shaper's hooks (its fork handlers, its dlsym). Without libibverbs (a musl image has none
 * that a glibc build could use) it says so and exits 0, as it does without the shaper. */
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <sys/wait.h>
#include <unistd.h>

static void *worker(void *arg) {
  *(int *)arg = 42;
  return NULL;
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
  printf("libc_probe: thread, fork, libibverbs %s\n", open_device ? "found" : "absent");
  return 0;
}
