/*
 * An application that finds its verbs as NCCL's verbs wrapper does: it loads libibverbs
 * with dlopen("libibverbs.so.1", RTLD_NOW | RTLD_LOCAL) and fills a table of verbs with
 * dlvsym(handle, name, "IBVERBS_1.1"), each at its symbol version. A handle look-up
 * searches libibverbs and its dependencies, not the preloaded shaper, so this is the case
 * the shaper's own dlvsym must catch. Otherwise it is dlopen_app (same exchange, same
 * "result" line, same arguments).
 *
 *   nccl_style_app [DEVICE [GID_INDEX]]
 */
#define _GNU_SOURCE
#define VERBS_BY_VERSION "IBVERBS_1.1"
#include "dlopen_app.c"
