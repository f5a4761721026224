/*
 * An MPI program that moves data the ways MPI applications do and checks every byte:
 * two-sided messages in both directions (MPI_Send/MPI_Recv), then one-sided MPI_Put and
 * MPI_Get in a window (MPI_Win_allocate, fence epochs), for each of several sizes up to
 * a few MiB. Every buffer is filled with a pattern that depends on the size, the
 * direction and the byte's offset, so a lost, duplicated, reordered or shifted piece of a
 * message shows up as a mismatch.
 *
 *   mpirun -np 2 mpi_check [MAX_BYTES]   (default 4 MiB)
 *
 * Runs with exactly two ranks. Prints one line per size and direction with the bytes
 * checked, and on rank 0 a final "result" line that is the same on every clean run of the
 * same MAX_BYTES. Exit status: 0 when every byte matched on both ranks, 1 on any mismatch
 * (the first one is printed with its offset, expected and found byte), 2 on a usage error.
 */
#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <mpi.h>

/* The pattern byte at offset i of the buffer of case `tag`. */
static unsigned char pattern(size_t i, unsigned tag)
{
	uint64_t x = (uint64_t)i * 0x9e3779b97f4a7c15ULL + (uint64_t)tag * 0xbf58476d1ce4e5b9ULL;
	x ^= x >> 29;
	return (unsigned char)(x ^ (x >> 47) ^ (i >> 12));
}

static void fill(unsigned char *buf, size_t n, unsigned tag)
{
	for (size_t i = 0; i < n; i++)
		buf[i] = pattern(i, tag);
}

/* Counts the bytes of buf that differ from the pattern; prints the first. */
static size_t verify(const unsigned char *buf, size_t n, unsigned tag, int rank, const char *what)
{
	size_t bad = 0;
	for (size_t i = 0; i < n; i++) {
		unsigned char want = pattern(i, tag);
		if (buf[i] != want) {
			if (bad == 0)
				fprintf(stderr, "mpi_check: rank %d: FAIL: %s of %zu bytes: first mismatch at offset %zu: expected 0x%02x, found 0x%02x\n",
					rank, what, n, i, want, buf[i]);
			bad++;
		}
	}
	if (bad)
		fprintf(stderr, "mpi_check: rank %d: FAIL: %s of %zu bytes: %zu bytes differ\n", rank, what, n, bad);
	return bad;
}

int main(int argc, char **argv)
{
	int rank, size;
	MPI_Init(&argc, &argv);
	MPI_Comm_rank(MPI_COMM_WORLD, &rank);
	MPI_Comm_size(MPI_COMM_WORLD, &size);
	size_t max = 4u << 20;
	if (argc > 1) {
		char *end;
		unsigned long long v = strtoull(argv[1], &end, 0);
		if (*end != '\0' || v == 0 || v > (1ULL << 30)) {
			if (rank == 0)
				fprintf(stderr, "mpi_check: bad MAX_BYTES %s\n", argv[1]);
			MPI_Finalize();
			return 2;
		}
		max = (size_t)v;
	}
	if (size != 2) {
		if (rank == 0)
			fprintf(stderr, "mpi_check: needs exactly 2 ranks, got %d\n", size);
		MPI_Finalize();
		return 2;
	}
	int peer = 1 - rank;
	/* Small (eager), odd-sized and large (rendezvous, split by a shaper) messages. */
	size_t sizes[] = {1, 4096, 65536 + 13, 1u << 20, 3u * (1u << 20) + 4097, max};
	int nsizes = (int)(sizeof(sizes) / sizeof(sizes[0]));
	unsigned char *buf = malloc(max);
	unsigned char *win_mem;
	MPI_Win win;
	if (!buf) {
		fprintf(stderr, "mpi_check: rank %d: out of memory\n", rank);
		MPI_Abort(MPI_COMM_WORLD, 2);
	}
	MPI_Win_allocate((MPI_Aint)max, 1, MPI_INFO_NULL, MPI_COMM_WORLD, &win_mem, &win);

	size_t bad = 0, checked = 0;
	for (int s = 0; s < nsizes; s++) {
		size_t n = sizes[s];
		if (n > max)
			continue;
		char what[64];
		/* Two-sided: rank 0 to rank 1, then back with another pattern. */
		for (int dir = 0; dir < 2; dir++) {
			unsigned tag = (unsigned)(s * 8 + dir);
			if (rank == dir) {
				fill(buf, n, tag);
				MPI_Send(buf, (int)n, MPI_BYTE, peer, (int)tag, MPI_COMM_WORLD);
			} else {
				memset(buf, 0, n);
				MPI_Recv(buf, (int)n, MPI_BYTE, peer, (int)tag, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
				snprintf(what, sizeof(what), "MPI_Recv from rank %d", peer);
				bad += verify(buf, n, tag, rank, what);
				checked += n;
			}
		}
		/* One-sided: each rank puts its pattern into the other's window. */
		unsigned put_tag = (unsigned)(s * 8 + 2 + rank);
		memset(win_mem, 0, n);
		fill(buf, n, put_tag);
		MPI_Win_fence(0, win);
		MPI_Put(buf, (int)n, MPI_BYTE, peer, 0, (int)n, MPI_BYTE, win);
		MPI_Win_fence(0, win);
		snprintf(what, sizeof(what), "MPI_Put by rank %d", peer);
		bad += verify(win_mem, n, (unsigned)(s * 8 + 2 + peer), rank, what);
		checked += n;
		/* Then each gets the other's window, refilled locally with a third pattern. */
		fill(win_mem, n, (unsigned)(s * 8 + 4 + rank));
		memset(buf, 0, n);
		MPI_Win_fence(0, win);
		MPI_Get(buf, (int)n, MPI_BYTE, peer, 0, (int)n, MPI_BYTE, win);
		MPI_Win_fence(0, win);
		snprintf(what, sizeof(what), "MPI_Get from rank %d", peer);
		bad += verify(buf, n, (unsigned)(s * 8 + 4 + peer), rank, what);
		checked += n;
		printf("mpi_check: rank %d: %zu bytes: send/recv, put, get checked\n", rank, n);
		fflush(stdout);
	}
	MPI_Win_free(&win);

	unsigned long long mine[2] = {bad, checked}, all[2];
	MPI_Allreduce(mine, all, 2, MPI_UNSIGNED_LONG_LONG, MPI_SUM, MPI_COMM_WORLD);
	if (rank == 0) {
		if (all[0] == 0)
			printf("mpi_check: result PASS: %llu bytes checked on 2 ranks, 0 mismatched\n", all[1]);
		else
			printf("mpi_check: result FAIL: %llu bytes checked on 2 ranks, %llu mismatched\n", all[1], all[0]);
	}
	free(buf);
	MPI_Finalize();
	return all[0] == 0 ? 0 : 1;
}
