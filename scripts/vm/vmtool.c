/*
 * vmtool: the helper program of scripts/vm-test.sh, run inside the test VM.
 * Built statically by the host script (gcc -O2 -static), so it needs nothing
 * from the initramfs.
 *
 *   vmtool now
 *       Monotonic clock in seconds with nanoseconds (busybox date has no %N).
 *   vmtool clock
 *       Seconds since midnight UTC with microseconds, the time of day of the daemon's log
 *       lines (to time an event against them).
 *   vmtool gen BYTES SEED
 *       Writes BYTES (a multiple of 4096) of the mixed page pattern to stdout.
 *   vmtool pressure MIB SEED [HOLDFILE]
 *       Fills MIB MiB of anonymous memory with the mixed pattern, verifies every
 *       word twice, rewrites every third page with a second pattern and verifies
 *       every word once more. Prints counts; exits 1 on any mismatch. With
 *       VMTOOL_PASSES=0, 1 or 2 in the environment: fill and that many verify
 *       passes only, no rewrite (0: only with the after-hold pass below). With
 *       VMTOOL_PHASE_FILE set, writes the phase it is in ("fill", "verify-1", ...,
 *       "done") to that file as it starts each (so a test can act while pages go out,
 *       or while they come back). With
 *       HOLDFILE, creates it when done and keeps the memory until it is removed
 *       (so the swap device can be inspected while it holds the data); with
 *       VMTOOL_VERIFY_AFTER_HOLD=1 as well, verifies every word once more after that
 *       and prints PRESSURE_AFTER_HOLD_* counts.
 *   vmtool scatter MIB PROCS SEED
 *       PROCS processes at once each fill MIB/PROCS MiB of anonymous memory with the
 *       mixed pattern (seed SEED + process number) and verify it twice, a page at a time
 *       in random order (another access pattern than pressure's sequential passes).
 *       Prints SCATTER_WORDS_CHECKED and SCATTER_BAD_WORDS; exits 1 on any mismatch or
 *       failed process.
 *   vmtool pageout MIB SEED [random] [wait]
 *       Fills MIB MiB of anonymous memory with the mixed pattern (with `random`, random
 *       words: nothing compresses, as a stress-ng move-inv worker's) 16 MiB at a time,
 *       pushing each part out to swap with MADV_PAGEOUT as it goes (so the program
 *       never needs much RAM), prints PAGEOUT_SWAPPED_KB (its VmSwap) and exits (with
 *       `wait`, waits to be killed): the kernel frees every slot it had.
 *   vmtool pageout-pid PID
 *       Pages out every private mapping of process PID (process_madvise MADV_PAGEOUT; pages
 *       its memory cgroup may not swap stay) and prints its VmSwap before and after.
 *   vmtool wakeup PERIOD_MS SECONDS
 *       An ordinary process (no locking, no priority) that wakes every PERIOD_MS for
 *       SECONDS and prints WAKEUP_MAX_DELAY_MS, the longest it woke up late: how long
 *       a user's shell would have stalled.
 *   vmtool stalls PID SECONDS
 *       Watches process PID (the wake-up timer, or a shell whose child runs it) for
 *       SECONDS, locked in memory at real-time priority, sampling every 20 ms its state, its
 *       kernel stack and the requests in flight on /sys/block/ublkb0 and zram0. Whenever PID
 *       is anywhere but asleep in its own timer for 1 s or more, prints the episode: when,
 *       how long, and each distinct state and stack seen in it, with how many samples found
 *       it there and the requests in flight (the first 3 episodes, up to 8 stacks each); in
 *       the first episode to reach 1.5 s, also every daemon thread's state and kernel stack
 *       (as the monitor does), to tell whether a page's swap-in waited for the device or for
 *       memory to read it into. When the daemon's log says a write starved while its refill
 *       thread ran, asks every CPU for its backtrace (sysrq l, twice a run at most).
 *   vmtool rss-settle PID LIMIT_KB TIMEOUT_S
 *       Polls PID's VmRSS every 20 ms until it is at most LIMIT_KB, or TIMEOUT_S
 *       passed; prints RSS_SETTLE_S (-1 if never) and RSS_SETTLE_KB (the last value).
 *   vmtool notify-run TIMEOUT_S STATEFILE CMD [ARGS...]
 *       Runs CMD the way systemd runs a Type=notify service: NOTIFY_SOCKET points
 *       to a datagram socket this program reads. Appends to STATEFILE "pid N" at
 *       start, "ready SECONDS" when CMD sends READY=1, "timeout" if that takes
 *       longer than TIMEOUT_S, and "exit CODE" when CMD ends. Runs until CMD ends
 *       (start it in the background); exits 0 if CMD was ready and exited 0.
 *   vmtool job CMD [ARGS...]
 *       Runs CMD as an interactive shell runs a job: in a process group of its own, below
 *       vmtool in a session of its own, so that the group is not orphaned and job control
 *       (SIGTSTP, SIGTTIN, SIGTTOU) stops it by default (the kernel drops those signals for
 *       an orphaned group, as is every group in the VM's init session). Exits with its
 *       status (128 + the signal if one ended it).
 *   vmtool heartbeat DEV OFFSET STOPFILE
 *       Until STOPFILE exists: writes 64 KiB at byte OFFSET of block device DEV with
 *       O_DIRECT (a pattern made of the round number), reads it back and compares, as
 *       fast as it can. Prints HEARTBEAT_ROUNDS, HEARTBEAT_BAD (rounds whose write or read
 *       failed or read back wrong) and HEARTBEAT_MAX_STALL_S (the longest round: the
 *       longest pause the device's I/O had, a daemon's death and restart included);
 *       exits 1 if any round was bad.
 *   vmtool shm-remove KEY
 *       Removes the SysV shared memory segment with KEY (busybox has no ipcrm); exits 1
 *       if there is none.
 *   vmtool bitflip DEV KEY
 *       A bit flipped in RAM under a stored page: writes 8 pages of random words (stored
 *       raw: nothing compresses) at the start of block device DEV with O_DIRECT, waits a
 *       second for the daemon to store them, flips a bit of every copy of page 3 in its
 *       SysV segment KEY (the store's memory; only pages resident there are looked at),
 *       then reads the 8 pages back as 8 one-page reads submitted at once (Linux AIO, in
 *       one plug: the block layer merges them into one request, as swap's readahead is),
 *       and page 4 again alone. Prints BITFLIP_COPIES (copies flipped), BITFLIP_PAGES (each
 *       page's result: ok, bad for wrong data, or the errno's name) and BITFLIP_ALONE;
 *       exits 0 if pages 0 to 2 read back right, page 3 failed with EIO and page 4 alone
 *       read back right.
 *   vmtool monitor INTERVAL_S DEADLINE_S STALL_S FLAGFILE
 *       The VM's watchdog, started first by test.sh: locked in memory, real-time
 *       priority and with every file opened up front, so it still runs when the test
 *       is stuck in reclaim. Every INTERVAL_S prints free memory, free swap, the
 *       swap counters and the resident size of each trueno-ublk process. At
 *       DEADLINE_S, or when FLAGFILE exists (a pressure run is on) and no page was
 *       swapped in or out for STALL_S, it prints the end of each daemon log and every
 *       daemon thread's state twice (a second apart), dumps blocked tasks, all tasks,
 *       the running CPUs and memory to the console (sysrq w, t, l, m), prints a FAIL
 *       verdict and powers the VM off. Samples every second and keeps the last
 *       ACCOUNT_SAMPLES; on SIGUSR1 (the init's, when the test ended with an error: its
 *       shell killed by the OOM killer, say) prints them, every process's state, resident
 *       and swapped size, OOM score adjustment and wait channel, the kernel stack of each
 *       thread in uninterruptible sleep and every daemon thread's, creates
 *       /run/monitor-account-done and exits.
 *
 * The mixed pattern: page p (4 KiB) of a run with seed s is
 *   - all zero when p % 50 == 0 (2%: same-filled pages never reach a codec),
 *   - random words when p % 50 == 1 (2%: incompressible),
 *   - otherwise blocks of 8 words whose first 2 words are random and whose last 6
 *     repeat the previous block's last 6: LZ4 compresses it about 3x.
 * Every word is a function of (seed, page, word index), so any page can be
 * re-derived and compared word by word.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <glob.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <sys/mman.h>
#include <sys/shm.h>
#include <sys/reboot.h>
#include <sys/resource.h>
#include <sched.h>
#include <fcntl.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <linux/aio_abi.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define PAGE_BYTES 4096
#define PAGE_WORDS (PAGE_BYTES / 8)

static double now_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static uint64_t splitmix64(uint64_t *state)
{
	uint64_t z = (*state += 0x9E3779B97F4A7C15ULL);
	z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
	z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
	return z ^ (z >> 31);
}

enum page_kind { PAGE_ZERO, PAGE_RANDOM, PAGE_MIXED };

static enum page_kind kind_of(uint64_t page)
{
	switch (page % 50) {
	case 0:
		return PAGE_ZERO;
	case 1:
		return PAGE_RANDOM;
	default:
		return PAGE_MIXED;
	}
}

static void make_page(uint64_t *out, uint64_t seed, uint64_t page)
{
	uint64_t state = seed * 0xD1B54A32D192ED03ULL ^ page;
	switch (kind_of(page)) {
	case PAGE_ZERO:
		memset(out, 0, PAGE_BYTES);
		return;
	case PAGE_RANDOM:
		for (int i = 0; i < PAGE_WORDS; i++)
			out[i] = splitmix64(&state);
		return;
	case PAGE_MIXED:
		for (int i = 0; i < PAGE_WORDS; i++) {
			if (i % 8 < 2 || i < 8)
				out[i] = splitmix64(&state);
			else
				out[i] = out[i - 8];
		}
		return;
	}
}

static unsigned long long parse_u64(const char *s, const char *what)
{
	char *end;
	errno = 0;
	unsigned long long v = strtoull(s, &end, 0);
	if (errno || *end || end == s) {
		fprintf(stderr, "vmtool: bad %s: %s\n", what, s);
		exit(2);
	}
	return v;
}

static int cmd_gen(int argc, char **argv)
{
	if (argc != 2) {
		fprintf(stderr, "usage: vmtool gen BYTES SEED\n");
		return 2;
	}
	uint64_t bytes = parse_u64(argv[0], "byte count");
	uint64_t seed = parse_u64(argv[1], "seed");
	if (bytes % PAGE_BYTES) {
		fprintf(stderr, "vmtool: BYTES must be a multiple of 4096\n");
		return 2;
	}
	uint64_t buf[PAGE_WORDS * 16];
	uint64_t pages = bytes / PAGE_BYTES;
	for (uint64_t p = 0; p < pages;) {
		uint64_t n = 0;
		for (; n < 16 && p < pages; n++, p++)
			make_page(buf + n * PAGE_WORDS, seed, p);
		if (fwrite(buf, PAGE_BYTES, n, stdout) != n) {
			perror("vmtool gen: write");
			return 1;
		}
	}
	return fflush(stdout) ? 1 : 0;
}

struct verify_counts {
	uint64_t words;
	uint64_t bad_words;
	uint64_t bad_pages;
};

/* Page p holds seed_for(p): seed_a, or seed_b for every third page once rewritten. */
static uint64_t seed_for(uint64_t page, uint64_t seed_a, uint64_t seed_b, int rewritten)
{
	return rewritten && page % 3 == 0 ? seed_b : seed_a;
}

/* Tell a watching test which phase the pressure program is in (VMTOOL_PHASE_FILE). */
static void phase(const char *name)
{
	const char *path = getenv("VMTOOL_PHASE_FILE");
	if (!path || !*path)
		return;
	char tmp[4096];
	snprintf(tmp, sizeof(tmp), "%s.tmp", path);
	FILE *f = fopen(tmp, "w");
	if (!f)
		return;
	fprintf(f, "%s\n", name);
	if (fclose(f) == 0)
		rename(tmp, path);
}

static void verify_pass(const char *name, uint64_t *mem, uint64_t pages, uint64_t seed_a,
			uint64_t seed_b, int rewritten, struct verify_counts *total)
{
	uint64_t expect[PAGE_WORDS];
	struct verify_counts c = { 0, 0, 0 };
	double t0 = now_s();
	phase(name);
	for (uint64_t p = 0; p < pages; p++) {
		uint64_t *got = mem + p * PAGE_WORDS;
		make_page(expect, seed_for(p, seed_a, seed_b, rewritten), p);
		c.words += PAGE_WORDS;
		if (memcmp(got, expect, PAGE_BYTES) == 0)
			continue;
		c.bad_pages++;
		for (int i = 0; i < PAGE_WORDS; i++) {
			if (got[i] == expect[i])
				continue;
			if (c.bad_words < 8)
				printf("MISMATCH %s page %llu word %d: expected %016llx got %016llx\n",
				       name, (unsigned long long)p, i,
				       (unsigned long long)expect[i], (unsigned long long)got[i]);
			c.bad_words++;
		}
	}
	printf("pressure: %s: %llu words checked, %llu mismatched words in %llu pages, %.1f s\n",
	       name, (unsigned long long)c.words, (unsigned long long)c.bad_words,
	       (unsigned long long)c.bad_pages, now_s() - t0);
	fflush(stdout);
	total->words += c.words;
	total->bad_words += c.bad_words;
	total->bad_pages += c.bad_pages;
}

static int cmd_pressure(int argc, char **argv)
{
	if (argc != 2 && argc != 3) {
		fprintf(stderr, "usage: vmtool pressure MIB SEED [HOLDFILE]\n");
		return 2;
	}
	uint64_t mib = parse_u64(argv[0], "MiB");
	uint64_t seed_a = parse_u64(argv[1], "seed");
	uint64_t seed_b = seed_a ^ 0x5DEECE66DULL;
	uint64_t pages = mib * 256;
	size_t bytes = (size_t)pages * PAGE_BYTES;
	uint64_t *mem = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (mem == MAP_FAILED) {
		perror("vmtool pressure: mmap");
		return 1;
	}
	/* Keep transparent huge pages out: the test is about 4 KiB swap traffic. */
	madvise(mem, bytes, MADV_NOHUGEPAGE);
	printf("pressure: %llu MiB (%llu pages): 2%% zero, 2%% random, 96%% mixed\n",
	       (unsigned long long)mib, (unsigned long long)pages);
	fflush(stdout);
	double t0 = now_s();
	phase("fill");
	/* VMTOOL_PAGEOUT=1: each 16 MiB filled is paged out at once, and all of it again before
	 * the hold: the pages go out to swap without RAM ever reaching the watermark (as an
	 * administrator's swap looks when the daemon is restarted), not by reclaim. */
	const char *pageout_env = getenv("VMTOOL_PAGEOUT");
	int pageout = pageout_env && *pageout_env == '1';
	const uint64_t part = 16 * 256;
	for (uint64_t p = 0; p < pages; p++) {
		make_page(mem + p * PAGE_WORDS, seed_a, p);
		if (pageout && (p + 1) % part == 0 &&
		    madvise(mem + (p + 1 - part) * PAGE_WORDS, part * PAGE_BYTES, MADV_PAGEOUT))
			perror("vmtool pressure: MADV_PAGEOUT");
	}
	printf("pressure: fill: %llu words written, %.1f s\n",
	       (unsigned long long)pages * PAGE_WORDS, now_s() - t0);
	fflush(stdout);

	struct verify_counts total = { 0, 0, 0 };
	const char *passes_env = getenv("VMTOOL_PASSES");
	/* 3 (the default): two passes and the rewrite; 0 only makes sense with the
	 * after-hold pass below. */
	int passes = passes_env && *passes_env ? atoi(passes_env) : 3;
	if (passes < 0 || passes > 3)
		passes = 3;
	if (passes >= 1)
		verify_pass("verify-1", mem, pages, seed_a, seed_b, 0, &total);
	if (passes >= 2)
		verify_pass("verify-2", mem, pages, seed_a, seed_b, 0, &total);
	if (passes >= 3) {
		double t1 = now_s();
		for (uint64_t p = 0; p < pages; p += 3)
			make_page(mem + p * PAGE_WORDS, seed_b, p);
		printf("pressure: rewrite: every third page with a second pattern, %.1f s\n",
		       now_s() - t1);
		fflush(stdout);
		verify_pass("verify-3", mem, pages, seed_a, seed_b, 1, &total);
	}

	printf("pressure: total %llu words checked (%.2fx the %llu words filled), "
	       "%llu mismatched words in %llu pages, %.1f s\n",
	       (unsigned long long)total.words, (double)total.words / (double)(pages * PAGE_WORDS),
	       (unsigned long long)pages * PAGE_WORDS, (unsigned long long)total.bad_words,
	       (unsigned long long)total.bad_pages, now_s() - t0);
	phase("done");
	printf("PRESSURE_WORDS_CHECKED=%llu\nPRESSURE_BAD_WORDS=%llu\n",
	       (unsigned long long)total.words, (unsigned long long)total.bad_words);
	fflush(stdout);
	if (argc == 3) {
		if (pageout) {
			if (madvise(mem, bytes, MADV_PAGEOUT))
				perror("vmtool pressure: MADV_PAGEOUT");
			printf("pressure: paged out before the hold\n");
			fflush(stdout);
		}
		FILE *hold = fopen(argv[2], "w");
		if (!hold || fclose(hold)) {
			perror("vmtool pressure: holdfile");
			return 1;
		}
		while (access(argv[2], F_OK) == 0)
			usleep(100000);
		/* What happened while the memory was held (a daemon restart, say) must not have
		 * changed a word: one more pass, reported apart. */
		const char *after_env = getenv("VMTOOL_VERIFY_AFTER_HOLD");
		if (after_env && *after_env == '1') {
			struct verify_counts after = { 0, 0, 0 };
			verify_pass("after-hold", mem, pages, seed_a, seed_b, passes >= 3, &after);
			printf("PRESSURE_AFTER_HOLD_WORDS_CHECKED=%llu\n"
			       "PRESSURE_AFTER_HOLD_BAD_WORDS=%llu\n",
			       (unsigned long long)after.words, (unsigned long long)after.bad_words);
			fflush(stdout);
			total.bad_words += after.bad_words;
		}
	}
	munmap(mem, bytes);
	return total.bad_words == 0 ? 0 : 1;
}

/* One process of `scatter`: returns the mismatched words, or -1 if it could not map. */
static long long scatter_worker(uint64_t pages, uint64_t seed, uint64_t *words)
{
	size_t bytes = (size_t)pages * PAGE_BYTES;
	uint64_t *mem = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (mem == MAP_FAILED)
		return -1;
	madvise(mem, bytes, MADV_NOHUGEPAGE);
	for (uint64_t p = 0; p < pages; p++)
		make_page(mem + p * PAGE_WORDS, seed, p);
	uint64_t expect[PAGE_WORDS];
	uint64_t order = seed ^ 0xA0761D6478BD642FULL;
	long long bad = 0;
	for (uint64_t n = 0; n < 2 * pages; n++) {
		uint64_t p = splitmix64(&order) % pages;
		uint64_t *got = mem + p * PAGE_WORDS;
		make_page(expect, seed, p);
		*words += PAGE_WORDS;
		if (memcmp(got, expect, PAGE_BYTES) == 0)
			continue;
		for (int i = 0; i < PAGE_WORDS; i++)
			bad += got[i] != expect[i];
	}
	munmap(mem, bytes);
	return bad;
}

static int cmd_scatter(int argc, char **argv)
{
	if (argc != 3) {
		fprintf(stderr, "usage: vmtool scatter MIB PROCS SEED\n");
		return 2;
	}
	uint64_t mib = parse_u64(argv[0], "MiB");
	uint64_t procs = parse_u64(argv[1], "process count");
	uint64_t seed = parse_u64(argv[2], "seed");
	if (procs == 0 || procs > 64) {
		fprintf(stderr, "vmtool scatter: PROCS must be 1..64\n");
		return 2;
	}
	uint64_t pages = mib * 256 / procs;
	int fds[64][2];
	double t0 = now_s();
	for (uint64_t k = 0; k < procs; k++) {
		if (pipe(fds[k]) != 0) {
			perror("vmtool scatter: pipe");
			return 1;
		}
		pid_t pid = fork();
		if (pid < 0) {
			perror("vmtool scatter: fork");
			return 1;
		}
		if (pid == 0) {
			uint64_t words = 0;
			long long bad = scatter_worker(pages, seed + k, &words);
			unsigned long long out[2] = { words, (unsigned long long)bad };
			if (write(fds[k][1], out, sizeof(out)) != (ssize_t)sizeof(out))
				_exit(1);
			_exit(bad == 0 ? 0 : 1);
		}
		close(fds[k][1]);
	}
	uint64_t words = 0, bad = 0, failed = 0;
	for (uint64_t k = 0; k < procs; k++) {
		unsigned long long in[2];
		if (read(fds[k][0], in, sizeof(in)) != (ssize_t)sizeof(in) || (long long)in[1] < 0) {
			failed++;
			continue;
		}
		words += in[0];
		bad += in[1];
	}
	int status;
	while (wait(&status) > 0)
		if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
			failed++;
	printf("scatter: %llu processes x %llu pages, every page verified twice in random order: "
	       "%llu words checked, %llu mismatched, %llu processes failed, %.1f s\n",
	       (unsigned long long)procs, (unsigned long long)pages, (unsigned long long)words,
	       (unsigned long long)bad, (unsigned long long)failed, now_s() - t0);
	printf("SCATTER_WORDS_CHECKED=%llu\nSCATTER_BAD_WORDS=%llu\n", (unsigned long long)words,
	       (unsigned long long)bad);
	fflush(stdout);
	return bad == 0 && failed == 0 ? 0 : 1;
}

static void state_line(const char *path, const char *fmt, ...)
{
	FILE *f = fopen(path, "a");
	if (!f)
		return;
	va_list ap;
	va_start(ap, fmt);
	vfprintf(f, fmt, ap);
	va_end(ap);
	fclose(f);
}

static int cmd_notify_run(int argc, char **argv)
{
	if (argc < 3) {
		fprintf(stderr, "usage: vmtool notify-run TIMEOUT_S STATEFILE CMD [ARGS...]\n");
		return 2;
	}
	double timeout = (double)parse_u64(argv[0], "timeout");
	const char *statefile = argv[1];
	struct sockaddr_un addr = { .sun_family = AF_UNIX };
	snprintf(addr.sun_path, sizeof(addr.sun_path), "/run/vmtool-notify-%d.sock", (int)getpid());
	unlink(addr.sun_path);
	int sock = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
	if (sock < 0 || bind(sock, (struct sockaddr *)&addr, sizeof(addr)) < 0) {
		perror("vmtool notify-run: socket");
		return 1;
	}
	unlink(statefile);
	double t0 = now_s();
	pid_t child = fork();
	if (child < 0) {
		perror("vmtool notify-run: fork");
		return 1;
	}
	if (child == 0) {
		setenv("NOTIFY_SOCKET", addr.sun_path, 1);
		execvp(argv[2], argv + 2);
		perror("vmtool notify-run: exec");
		_exit(127);
	}
	state_line(statefile, "pid %d\n", (int)child);
	int ready = 0;
	for (;;) {
		int status;
		if (waitpid(child, &status, WNOHANG) == child) {
			int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
			printf("notify-run: %s exited with %d%s\n", argv[2], code,
			       ready ? "" : " before READY=1");
			state_line(statefile, "exit %d\n", code);
			unlink(addr.sun_path);
			return ready && code == 0 ? 0 : 1;
		}
		if (!ready && now_s() - t0 > timeout) {
			printf("notify-run: no READY=1 from %s within %.0f s\n", argv[2], timeout);
			state_line(statefile, "timeout\n");
			timeout = 1e12; /* report once; the caller decides what to do */
		}
		struct pollfd pfd = { .fd = sock, .events = POLLIN };
		if (poll(&pfd, 1, 100) <= 0)
			continue;
		char msg[4096];
		ssize_t n = recv(sock, msg, sizeof(msg) - 1, 0);
		if (n <= 0)
			continue;
		msg[n] = 0;
		printf("notify-run: received \"%s\"\n", msg);
		fflush(stdout);
		/* The message is newline-separated assignments; READY=1 may be any line. */
		for (char *line = strtok(msg, "\n"); line; line = strtok(NULL, "\n")) {
			if (!ready && strcmp(line, "READY=1") == 0) {
				ready = 1;
				state_line(statefile, "ready %.3f\n", now_s() - t0);
			}
		}
	}
}

static int cmd_job(int argc, char **argv)
{
	if (argc < 1) {
		fprintf(stderr, "usage: vmtool job CMD [ARGS...]\n");
		return 2;
	}
	if (setsid() < 0) {
		perror("vmtool job: setsid");
		return 1;
	}
	pid_t child = fork();
	if (child < 0) {
		perror("vmtool job: fork");
		return 1;
	}
	if (child == 0) {
		if (setpgid(0, 0) < 0) {
			perror("vmtool job: setpgid");
			_exit(127);
		}
		execvp(argv[0], argv);
		perror("vmtool job: exec");
		_exit(127);
	}
	int status;
	while (waitpid(child, &status, 0) < 0)
		if (errno != EINTR) {
			perror("vmtool job: waitpid");
			return 1;
		}
	return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

static int cmd_heartbeat(int argc, char **argv)
{
	if (argc != 3) {
		fprintf(stderr, "usage: vmtool heartbeat DEV OFFSET STOPFILE\n");
		return 2;
	}
	const size_t len = 64 << 10;
	off_t offset = (off_t)parse_u64(argv[1], "offset");
	int fd = open(argv[0], O_RDWR | O_DIRECT | O_CLOEXEC);
	void *out = NULL, *in = NULL;
	if (fd < 0 || posix_memalign(&out, 4096, len) || posix_memalign(&in, 4096, len)) {
		perror("vmtool heartbeat");
		return 1;
	}
	uint64_t rounds = 0, bad = 0;
	double worst = 0, worst_at = 0, t_start = now_s();
	while (access(argv[2], F_OK) != 0) {
		double t0 = now_s();
		for (size_t i = 0; i < len / 8; i++)
			((uint64_t *)out)[i] = rounds * 0x9E3779B97F4A7C15ULL + i;
		int ok = pwrite(fd, out, len, offset) == (ssize_t)len &&
			 pread(fd, in, len, offset) == (ssize_t)len && memcmp(in, out, len) == 0;
		double took = now_s() - t0;
		if (!ok) {
			bad++;
			if (bad <= 4)
				printf("heartbeat: round %llu bad (%s)\n", (unsigned long long)rounds,
				       strerror(errno));
		}
		if (took > worst) {
			worst = took;
			worst_at = t0 - t_start;
		}
		rounds++;
	}
	printf("heartbeat: longest round %.3f s, %.1f s after the start\n", worst, worst_at);
	printf("HEARTBEAT_ROUNDS=%llu\nHEARTBEAT_BAD=%llu\nHEARTBEAT_MAX_STALL_S=%.3f\n",
	       (unsigned long long)rounds, (unsigned long long)bad, worst);
	fflush(stdout);
	close(fd);
	return bad == 0 ? 0 : 1;
}

static int cmd_shm_remove(int argc, char **argv)
{
	if (argc != 1) {
		fprintf(stderr, "usage: vmtool shm-remove KEY\n");
		return 2;
	}
	int id = shmget((key_t)parse_u64(argv[0], "key"), 0, 0);
	if (id < 0 || shmctl(id, IPC_RMID, NULL) < 0) {
		perror("vmtool shm-remove");
		return 1;
	}
	return 0;
}

/* The value of KEY in a "key value" or "Key:   value kB" text. */
static long long field_of(const char *text, const char *key)
{
	size_t n = strlen(key);
	for (const char *p = text; p && *p; p = strchr(p, '\n'), p = p ? p + 1 : NULL) {
		if (strncmp(p, key, n) == 0 && (p[n] == ' ' || p[n] == ':'))
			return strtoll(p + n + 1 + strspn(p + n + 1, " :\t"), NULL, 10);
	}
	return -1;
}

/* Appends " trueno-ublk[PID]=RSS kB" for each daemon process to out. */
/* Read a small /proc file into buf (NUL-terminated, newlines kept); 0 if it cannot be read. */
static int read_small(const char *path, char *buf, size_t cap)
{
	int fd = open(path, O_RDONLY);
	if (fd < 0)
		return 0;
	ssize_t n = read(fd, buf, cap - 1);
	close(fd);
	buf[n > 0 ? n : 0] = 0;
	return n > 0;
}

/* The next process of `proc` (an open /proc) named trueno-ublk: its pid into `pid` (cap
 * bytes); 0 once there is none. */
static int next_daemon(DIR *proc, char *pid, size_t cap)
{
	struct dirent *e;
	while ((e = readdir(proc))) {
		if (e->d_name[0] < '1' || e->d_name[0] > '9')
			continue;
		char path[300], comm[64];
		snprintf(path, sizeof(path), "/proc/%s/comm", e->d_name);
		size_t len = strlen(e->d_name);
		if (len < cap && read_small(path, comm, sizeof(comm)) &&
		    strcmp(comm, "trueno-ublk\n") == 0) {
			memcpy(pid, e->d_name, len + 1);
			return 1;
		}
	}
	return 0;
}

/* The kernel stack of /proc/PID/stack already read into `stack`, as "fn < caller < ..." (the
 * innermost frames, offsets left out) into out. */
static void stack_line(char *stack, char *out, size_t cap)
{
	size_t used = 0;
	int frames = 0;
	out[0] = 0;
	for (char *line = strtok(stack, "\n"); line && frames < 12; line = strtok(NULL, "\n")) {
		char *fn = strchr(line, ' ');
		if (!fn)
			continue;
		fn++;
		fn[strcspn(fn, "+")] = 0;
		int n = snprintf(out + used, cap - used, "%s%s", frames++ ? " < " : "", fn);
		if (n < 0 || (size_t)n >= cap - used)
			break;
		used += (size_t)n;
	}
}

/* Where thread TID of PID is in the kernel (/proc/PID/task/TID/stack, root only). */
static void print_kernel_stack(const char *pid, const char *tid)
{
	char path[600], frames[600];
	static char stack[4096];
	snprintf(path, sizeof(path), "/proc/%s/task/%s/stack", pid, tid);
	if (!read_small(path, stack, sizeof(stack)))
		return;
	stack_line(stack, frames, sizeof(frames));
	printf("watchdog:   kernel: %s\n", frames);
}

/* Every thread of every trueno-ublk process: its state, page faults and CPU time from
 * /proc/PID/task/TID/stat, and what it is doing (/proc/.../syscall: the syscall and its
 * arguments, or "running", or -1 with the user stack and instruction pointers). Called twice,
 * a second apart, a thread that spins shows its faults or CPU time growing. */
static void print_daemon_threads(void)
{
	DIR *proc = opendir("/proc");
	if (!proc)
		return;
	char pid[32];
	while (next_daemon(proc, pid, sizeof(pid))) {
		char path[600];
		/* Where the binary is mapped, to place the user instruction pointers below. */
		snprintf(path, sizeof(path), "/proc/%s/maps", pid);
		static char maps[4096];
		if (read_small(path, maps, sizeof(maps)))
			printf("watchdog: %s maps from %.*s", pid,
			       (int)(strchr(maps, '\n') ? strchr(maps, '\n') - maps + 1 : 0), maps);
		snprintf(path, sizeof(path), "/proc/%s/task", pid);
		DIR *tasks = opendir(path);
		if (!tasks)
			continue;
		struct dirent *t;
		while ((t = readdir(tasks))) {
			if (t->d_name[0] < '1' || t->d_name[0] > '9')
				continue;
			char stat[1024], syscall[256];
			snprintf(path, sizeof(path), "/proc/%s/task/%s/stat", pid, t->d_name);
			if (!read_small(path, stat, sizeof(stat)))
				continue;
			snprintf(path, sizeof(path), "/proc/%s/task/%s/syscall", pid, t->d_name);
			if (!read_small(path, syscall, sizeof(syscall)))
				strcpy(syscall, "?\n");
			/* After the ")" that ends the name: state ppid pgrp session tty tpgid flags
			 * minflt cminflt majflt cmajflt utime stime. */
			char *rest = strrchr(stat, ')');
			char *name = strchr(stat, '(');
			if (!rest || !name)
				continue;
			*rest = 0;
			char state = 0;
			unsigned long long minflt = 0, majflt = 0, utime = 0, stime = 0;
			(void)sscanf(rest + 2, "%c %*d %*d %*d %*d %*d %*u %llu %*u %llu %*u %llu %llu",
				     &state, &minflt, &majflt, &utime, &stime);
			printf("watchdog: %s/%s %-16s %c minflt %llu majflt %llu utime %llu stime %llu "
			       "syscall %s",
			       pid, t->d_name, name + 1, state, minflt, majflt, utime, stime,
			       syscall);
			print_kernel_stack(pid, t->d_name);
		}
		closedir(tasks);
	}
	closedir(proc);
}

/* The last lines of each daemon log in /run/trueno-ublk: what the daemon said before a stall
 * (read here, by a process with its memory locked, not by a tool forked when memory is out). */
static void print_daemon_log_tails(void)
{
	glob_t logs;
	if (glob("/run/trueno-ublk/*.log", 0, NULL, &logs) != 0)
		return;
	for (size_t i = 0; i < logs.gl_pathc; i++) {
		static char tail[6144];
		int fd = open(logs.gl_pathv[i], O_RDONLY);
		if (fd < 0)
			continue;
		off_t size = lseek(fd, 0, SEEK_END);
		off_t from = size > (off_t)sizeof(tail) - 1 ? size - (off_t)sizeof(tail) + 1 : 0;
		ssize_t n = pread(fd, tail, sizeof(tail) - 1, from);
		close(fd);
		tail[n > 0 ? n : 0] = 0;
		printf("watchdog: the end of %s:\n%s\n", logs.gl_pathv[i], tail);
	}
	globfree(&logs);
}

static void daemons_rss(char *out, size_t cap)
{
	DIR *proc = opendir("/proc");
	if (!proc)
		return;
	size_t used = strlen(out);
	char pid[32];
	while (used + 64 < cap && next_daemon(proc, pid, sizeof(pid))) {
		char path[300], status[2048];
		snprintf(path, sizeof(path), "/proc/%s/status", pid);
		if (!read_small(path, status, sizeof(status)))
			continue;
		used += (size_t)snprintf(out + used, cap - used, " trueno-ublk[%s]=%lld kB", pid,
					 field_of(status, "VmRSS"));
	}
	closedir(proc);
}

/* Appends " zram0=KB" to `out`: the memory kernel zram holds for its pages (mm_stat's third
 * field, mem_used_total), while a zram device holds any; the daemon's RSS is the same figure
 * of ours. */
static void zram_memory(char *out, size_t cap)
{
	char mm_stat[256];
	long long orig, compr, used;
	size_t len = strlen(out);
	if (read_small("/sys/block/zram0/mm_stat", mm_stat, sizeof(mm_stat)) &&
	    sscanf(mm_stat, "%lld %lld %lld", &orig, &compr, &used) == 3 && used > 0 &&
	    len + 32 < cap)
		snprintf(out + len, cap - len, " zram0=%lld kB", used >> 10);
}

/* Task flags of /proc/PID/stat (include/linux/sched.h). */
#define PF_EXITING 0x00000004u
#define PF_KTHREAD 0x00200000u

/* One second of the monitor's record, for the account of a test that died. */
struct monitor_sample {
	double t;
	long long mem_free, mem_available, swap_free, swap_cached, pswpin, pswpout, oom_kill;
	char daemons[256];
};
#define ACCOUNT_SAMPLES 30
static volatile sig_atomic_t account_asked;

static void ask_for_account(int signal)
{
	(void)signal;
	account_asked = 1;
}

/* The next process of the /proc stream `proc` whose status can be read: its pid (pointing into
 * the stream's entry) and /proc/PID/status into `status`; 0 at the end. */
static int next_process(DIR *proc, const char **pid, char *status, size_t cap)
{
	struct dirent *e;
	while ((e = readdir(proc))) {
		if (e->d_name[0] < '1' || e->d_name[0] > '9')
			continue;
		char path[600];
		snprintf(path, sizeof(path), "/proc/%s/status", e->d_name);
		if (read_small(path, status, cap)) {
			*pid = e->d_name;
			return 1;
		}
	}
	return 0;
}

/* The state letter of a /proc/PID/status, '?' without one. */
static char state_letter(const char *status)
{
	const char *state = strstr(status, "State:");
	return state ? state[6 + strspn(state + 6, " \t")] : '?';
}

/* Every process but kernel threads, and every task in uninterruptible sleep: state (and
 * whether it is exiting), resident and swapped size, OOM score adjustment, wait channel; the
 * kernel stack of each of its threads in uninterruptible sleep. */
static void print_processes(void)
{
	DIR *proc = opendir("/proc");
	if (!proc)
		return;
	const char *pid;
	static char status[4096];
	while (next_process(proc, &pid, status, sizeof(status))) {
		char path[600], stat[1024], adj[32], wchan[128];
		char letter = state_letter(status);
		long long rss = field_of(status, "VmRSS");
		/* The task's flags (after the ")" that ends the name: state ppid pgrp session tty
		 * tpgid flags): kernel threads are left out unless blocked, and a process that is
		 * exiting (an OOM victim on its way out, its memory not yet freed) is said so. */
		unsigned flags = 0;
		snprintf(path, sizeof(path), "/proc/%s/stat", pid);
		char *after_name = read_small(path, stat, sizeof(stat)) ? strrchr(stat, ')') : NULL;
		if (after_name)
			(void)sscanf(after_name + 2, "%*c %*d %*d %*d %*d %*d %u", &flags);
		if ((flags & PF_KTHREAD) && letter != 'D')
			continue;
		snprintf(path, sizeof(path), "/proc/%s/oom_score_adj", pid);
		if (!read_small(path, adj, sizeof(adj)))
			strcpy(adj, "?");
		adj[strcspn(adj, "\n")] = 0;
		snprintf(path, sizeof(path), "/proc/%s/wchan", pid);
		if (!read_small(path, wchan, sizeof(wchan)))
			strcpy(wchan, "?");
		char *name = strstr(status, "Name:");
		int name_len = name ? (int)strcspn(name + 6, "\n") : 1;
		printf("account: pid %s %.*s state %c%s rss %lld kB swap %lld kB oom_score_adj %s "
		       "wchan %s\n",
		       pid, name_len, name ? name + 6 : "?", letter,
		       (flags & PF_EXITING) ? " exiting" : "", rss, field_of(status, "VmSwap"), adj,
		       wchan);
		snprintf(path, sizeof(path), "/proc/%s/task", pid);
		DIR *tasks = opendir(path);
		if (!tasks)
			continue;
		struct dirent *t;
		while ((t = readdir(tasks))) {
			char stat[1024];
			snprintf(path, sizeof(path), "/proc/%s/task/%s/stat", pid, t->d_name);
			if (t->d_name[0] < '1' || t->d_name[0] > '9' ||
			    !read_small(path, stat, sizeof(stat)))
				continue;
			char *rest = strrchr(stat, ')');
			if (rest && rest[1] == ' ' && rest[2] == 'D') {
				printf("account:   thread %s in D:\n", t->d_name);
				print_kernel_stack(pid, t->d_name);
			}
		}
		closedir(tasks);
	}
	closedir(proc);
}

/* Every process the kernel has sent SIGKILL (pending, shared: an OOM kill, `kill -9`) that is
 * blocked in D at the monitor's look, once a second, with where in the kernel: "monitor: t=T s
 * killed PID (NAME) blocked:" and its stack. Why: near OOM on our device the OOM killer's
 * victims took up to 2.9 s to exit (the OOM reaper took their memory first) where zram's exit
 * within a quarter of a second, and the kernel goes on to the next victim only once the last
 * one is gone or reaped (2026-12-06). */
static void print_killed_blocked(double t)
{
	DIR *proc = opendir("/proc");
	if (!proc)
		return;
	const char *pid;
	static char status[4096];
	while (next_process(proc, &pid, status, sizeof(status))) {
		char *pending = strstr(status, "ShdPnd:");
		if (!pending || state_letter(status) != 'D')
			continue;
		unsigned long long shared = strtoull(pending + 7, NULL, 16);
		if (!(shared & (1ull << (SIGKILL - 1))))
			continue;
		char *name = strstr(status, "Name:");
		int name_len = name ? (int)strcspn(name + 6, "\n") : 1;
		printf("monitor: t=%.1f s killed %s (%.*s) blocked:\n", t, pid, name_len,
		       name ? name + 6 : "?");
		print_kernel_stack(pid, pid);
	}
	closedir(proc);
	fflush(stdout);
}

/* The account of a test that died: the last seconds' samples (oldest first), every
 * process, every daemon thread. */
static void print_account(const struct monitor_sample *samples, unsigned taken)
{
	printf("account: the test ended with an error; the monitor's last %u seconds:\n",
	       taken < ACCOUNT_SAMPLES ? taken : ACCOUNT_SAMPLES);
	for (unsigned i = taken > ACCOUNT_SAMPLES ? taken - ACCOUNT_SAMPLES : 0; i < taken; i++) {
		const struct monitor_sample *s = &samples[i % ACCOUNT_SAMPLES];
		printf("account: t=%.1f s MemFree=%lld MemAvailable=%lld SwapFree=%lld "
		       "SwapCached=%lld kB pswpin=%lld pswpout=%lld oom_kill=%lld%s\n",
		       s->t, s->mem_free, s->mem_available, s->swap_free, s->swap_cached,
		       s->pswpin, s->pswpout, s->oom_kill, s->daemons);
	}
	print_processes();
	print_daemon_threads();
	fflush(stdout);
}

static int cmd_monitor(int argc, char **argv)
{
	if (argc != 4) {
		fprintf(stderr, "usage: vmtool monitor INTERVAL_S DEADLINE_S STALL_S FLAGFILE\n");
		return 2;
	}
	unsigned interval = (unsigned)parse_u64(argv[0], "interval");
	double deadline = (double)parse_u64(argv[1], "deadline");
	double stall_limit = (double)parse_u64(argv[2], "stall");
	const char *flagfile = argv[3];
	long long last_swaps = -1;
	double last_change = 0;
	int meminfo = open("/proc/meminfo", O_RDONLY);
	int vmstat = open("/proc/vmstat", O_RDONLY);
	int sysrq = open("/proc/sysrq-trigger", O_WRONLY);
	int printk = open("/proc/sys/kernel/printk", O_WRONLY);
	if (meminfo < 0 || vmstat < 0) {
		perror("vmtool monitor: /proc");
		return 1;
	}
	if (mlockall(MCL_CURRENT | MCL_FUTURE))
		perror("vmtool monitor: mlockall");
	struct sched_param sp = { .sched_priority = 50 };
	if (sched_setscheduler(0, SCHED_FIFO, &sp))
		perror("vmtool monitor: SCHED_FIFO");
	/* The watchdog must outlive whatever the OOM killer takes. */
	int own_adj = open("/proc/self/oom_score_adj", O_WRONLY);
	if (own_adj < 0 || write(own_adj, "-1000", 5) != 5)
		perror("vmtool monitor: oom_score_adj");
	if (own_adj >= 0)
		close(own_adj);
	/* No SA_RESTART: the signal ends the second's sleep. */
	struct sigaction on_usr1 = { .sa_handler = ask_for_account };
	sigaction(SIGUSR1, &on_usr1, NULL);
	FILE *pidfile = fopen("/run/monitor.pid", "w");
	if (pidfile) {
		fprintf(pidfile, "%d\n", (int)getpid());
		fclose(pidfile);
	}
	static char mem[8192], vm[16384];
	static struct monitor_sample samples[ACCOUNT_SAMPLES];
	double t0 = now_s();
	for (unsigned taken = 0;; taken++) {
		sleep(1);
		if (account_asked) {
			print_account(samples, taken);
			close(open("/run/monitor-account-done", O_WRONLY | O_CREAT, 0644));
			return 0;
		}
		ssize_t n = pread(meminfo, mem, sizeof(mem) - 1, 0);
		mem[n > 0 ? n : 0] = 0;
		n = pread(vmstat, vm, sizeof(vm) - 1, 0);
		vm[n > 0 ? n : 0] = 0;
		double t = now_s() - t0;
		struct monitor_sample *sample = &samples[taken % ACCOUNT_SAMPLES];
		*sample = (struct monitor_sample){
			.t = t,
			.mem_free = field_of(mem, "MemFree"),
			.mem_available = field_of(mem, "MemAvailable"),
			.swap_free = field_of(mem, "SwapFree"),
			.swap_cached = field_of(mem, "SwapCached"),
			.pswpin = field_of(vm, "pswpin"),
			.pswpout = field_of(vm, "pswpout"),
			.oom_kill = field_of(vm, "oom_kill"),
		};
		daemons_rss(sample->daemons, sizeof(sample->daemons));
		zram_memory(sample->daemons, sizeof(sample->daemons));
		print_killed_blocked(t);
		if ((taken + 1) % interval != 0)
			continue;
		printf("monitor: t=%.0f s MemFree=%lld kB MemAvailable=%lld kB SwapFree=%lld kB "
		       "SwapCached=%lld kB pswpout=%lld pswpin=%lld%s\n",
		       t, sample->mem_free, sample->mem_available, sample->swap_free,
		       sample->swap_cached, sample->pswpout, sample->pswpin, sample->daemons);
		fflush(stdout);
		long long swaps = field_of(vm, "pswpout") + field_of(vm, "pswpin");
		if (swaps != last_swaps || access(flagfile, F_OK) != 0) {
			last_swaps = swaps;
			last_change = t;
		}
		int stalled = t - last_change >= stall_limit;
		if (stalled)
			printf("FAIL: watchdog: swap stalled: no page swapped in or out for %.0f s "
			       "during a pressure run\n", t - last_change);
		if (stalled || t >= deadline) {
			if (!stalled)
				printf("FAIL: watchdog: the test was still running after %.0f s\n", t);
			/* The threads first: a report that keeps only the lines after the FAIL sees
			 * where each one waits. */
			print_daemon_threads();
			sleep(1);
			print_daemon_threads();
			print_daemon_log_tails();
			printf("FAIL: watchdog: blocked tasks, all tasks, the running CPUs and memory "
			       "are in the VM console (sysrq w, t, l, m)\n");
			printf("VMTEST RESULT: FAIL\n");
			fflush(stdout);
			/* The dumps are KERN_INFO: let them through to the console. */
			if (printk >= 0)
				(void)!write(printk, "8", 1);
			if (sysrq >= 0) {
				(void)!write(sysrq, "w", 1);
				(void)!write(sysrq, "t", 1);
				(void)!write(sysrq, "l", 1);
				(void)!write(sysrq, "m", 1);
			}
			sleep(2);
			sync();
			reboot(RB_POWER_OFF);
			return 1;
		}
	}
}

static int cmd_pageout(int argc, char **argv)
{
	int random = 0, wait = 0;
	for (int i = 2; i < argc; i++) {
		if (strcmp(argv[i], "random") == 0)
			random = 1;
		else if (strcmp(argv[i], "wait") == 0)
			wait = 1;
		else
			argc = 0;
	}
	if (argc < 2) {
		fprintf(stderr, "usage: vmtool pageout MIB SEED [random] [wait]\n");
		return 2;
	}
	uint64_t mib = parse_u64(argv[0], "MiB");
	uint64_t seed = parse_u64(argv[1], "seed");
	uint64_t pages = mib * 256;
	size_t bytes = (size_t)pages * PAGE_BYTES;
	const uint64_t part = 16 * 256;
	uint64_t *mem = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (mem == MAP_FAILED) {
		perror("vmtool pageout: mmap");
		return 1;
	}
	madvise(mem, bytes, MADV_NOHUGEPAGE);
	double t0 = now_s();
	for (uint64_t p = 0; p < pages; p += part) {
		uint64_t n = pages - p < part ? pages - p : part;
		for (uint64_t q = p; q < p + n; q++) {
			if (random) {
				uint64_t state = seed * 0xD1B54A32D192ED03ULL ^ q;
				for (int i = 0; i < PAGE_WORDS; i++)
					mem[q * PAGE_WORDS + i] = splitmix64(&state);
			} else {
				make_page(mem + q * PAGE_WORDS, seed, q);
			}
		}
		if (madvise(mem + p * PAGE_WORDS, n * PAGE_BYTES, MADV_PAGEOUT)) {
			perror("vmtool pageout: MADV_PAGEOUT");
			return 1;
		}
	}
	char buf[4096];
	int fd = open("/proc/self/status", O_RDONLY);
	ssize_t n = fd >= 0 ? read(fd, buf, sizeof(buf) - 1) : -1;
	if (fd >= 0)
		close(fd);
	buf[n > 0 ? n : 0] = 0;
	printf("pageout: %llu MiB filled and paged out in %.1f s\n", (unsigned long long)mib,
	       now_s() - t0);
	printf("PAGEOUT_SWAPPED_KB=%lld\n", field_of(buf, "VmSwap"));
	fflush(stdout);
	while (wait)
		pause();
	return 0;
}

/* The VmSwap of process `pid` in KiB, or -1. */
static long long vm_swap_kib(long pid)
{
	char path[64], buf[4096];
	snprintf(path, sizeof(path), "/proc/%ld/status", pid);
	int fd = open(path, O_RDONLY);
	ssize_t n = fd >= 0 ? read(fd, buf, sizeof(buf) - 1) : -1;
	if (fd >= 0)
		close(fd);
	if (n <= 0)
		return -1;
	buf[n] = 0;
	return field_of(buf, "VmSwap");
}

static int cmd_pageout_pid(int argc, char **argv)
{
	if (argc != 1) {
		fprintf(stderr, "usage: vmtool pageout-pid PID\n");
		return 2;
	}
	long pid = (long)parse_u64(argv[0], "pid");
	int pidfd = (int)syscall(SYS_pidfd_open, (pid_t)pid, 0);
	if (pidfd < 0) {
		perror("vmtool pageout-pid: pidfd_open");
		return 1;
	}
	char path[64], line[512];
	snprintf(path, sizeof(path), "/proc/%ld/maps", pid);
	FILE *maps = fopen(path, "r");
	if (!maps) {
		perror("vmtool pageout-pid: maps");
		return 1;
	}
	long long before = vm_swap_kib(pid);
	unsigned long mappings = 0, failed = 0;
	while (fgets(line, sizeof(line), maps)) {
		unsigned long start, end;
		char perms[5];
		/* Private mappings only: what swap can take from the process itself. */
		if (sscanf(line, "%lx-%lx %4s", &start, &end, perms) != 3 || perms[3] != 'p')
			continue;
		struct iovec range = { (void *)start, end - start };
		mappings++;
		if (syscall(SYS_process_madvise, pidfd, &range, 1, MADV_PAGEOUT, 0) < 0)
			failed++;
	}
	fclose(maps);
	close(pidfd);
	printf("pageout-pid: %ld: %lu private mappings paged out (%lu refused), VmSwap %lld kB "
	       "before, %lld kB after\n",
	       pid, mappings, failed, before, vm_swap_kib(pid));
	return 0;
}

static int cmd_wakeup(int argc, char **argv)
{
	if (argc != 2) {
		fprintf(stderr, "usage: vmtool wakeup PERIOD_MS SECONDS\n");
		return 2;
	}
	double period = (double)parse_u64(argv[0], "period") / 1000.0;
	double seconds = (double)parse_u64(argv[1], "seconds");
	double start = now_s(), worst = 0, worst_at = 0;
	/* Where the worst wake-up's time went: this program's own page faults then (a major one
	 * is a page of it swapped in: the device's read latency), and its time in the kernel. */
	long worst_majflt = 0, worst_minflt = 0;
	double worst_sys = 0;
	for (double due = start + period; due < start + seconds; due += period) {
		struct rusage before, after;
		getrusage(RUSAGE_SELF, &before);
		double t = now_s();
		if (due > t)
			usleep((useconds_t)((due - t) * 1e6));
		t = now_s();
		getrusage(RUSAGE_SELF, &after);
		if (t - due > worst) {
			worst = t - due;
			worst_at = t - start;
			worst_majflt = after.ru_majflt - before.ru_majflt;
			worst_minflt = after.ru_minflt - before.ru_minflt;
			worst_sys = (double)(after.ru_stime.tv_sec - before.ru_stime.tv_sec) +
				    (double)(after.ru_stime.tv_usec - before.ru_stime.tv_usec) / 1e6;
		}
		if (t > due + period)
			due = t; /* one long stall counts once, not as many missed wake-ups */
	}
	printf("WAKEUP_MAX_DELAY_MS=%.0f\n", worst * 1000.0);
	printf("WAKEUP_WORST_AT_S=%.1f WAKEUP_WORST_MAJFLT=%ld WAKEUP_WORST_MINFLT=%ld "
	       "WAKEUP_WORST_SYS_MS=%.0f\n",
	       worst_at, worst_majflt, worst_minflt, worst_sys * 1000.0);
	return 0;
}

/* Requests in flight on a block device into reads and writes; 0 where it has none. */
static int inflight_of(const char *dev, unsigned long *reads, unsigned long *writes)
{
	char path[128], buf[64];
	snprintf(path, sizeof(path), "/sys/block/%s/inflight", dev);
	*reads = *writes = 0;
	return read_small(path, buf, sizeof(buf)) && sscanf(buf, "%lu %lu", reads, writes) == 2;
}

#define STALL_STACKS 8
#define STALL_EPISODES 3
#define STARVED_BACKTRACES 2

/* The daemon's log says a write starved while its refill thread was running (state R, which
 * has no kernel stack to read): have every CPU print its backtrace to the kernel log (sysrq
 * l), at most STARVED_BACKTRACES times a run, so that where the refill thread runs shows
 * (issue 16: on Linux 7.3 it ran, where on 6.12 it slept in reclaim's throttle). Reads what
 * the log gained since the last look from *fd (opened at its end on the first call). */
static void backtrace_running_refill(int *fd, int *dumps, double at)
{
	static char buf[8192];
	if (*fd < 0) {
		*fd = open("/run/trueno-ublk/ublkb0.log", O_RDONLY);
		if (*fd >= 0)
			lseek(*fd, 0, SEEK_END);
		return;
	}
	ssize_t n;
	while ((n = read(*fd, buf, sizeof(buf) - 1)) > 0) {
		buf[n] = 0;
		if (*dumps >= STARVED_BACKTRACES || !strstr(buf, "starved for memory") ||
		    !strstr(buf, "refill_kernel_stack=\"R"))
			continue;
		int sysrq = open("/proc/sysrq-trigger", O_WRONLY);
		if (sysrq >= 0) {
			if (write(sysrq, "l", 1) == 1) {
				(*dumps)++;
				printf("STARVED at %.1f s with the refill thread running: the CPUs' "
				       "backtraces (sysrq l) go to the kernel log\n",
				       at);
				fflush(stdout);
			}
			close(sysrq);
		}
	}
}

static int cmd_stalls(int argc, char **argv)
{
	if (argc != 2) {
		fprintf(stderr, "usage: vmtool stalls PID SECONDS\n");
		return 2;
	}
	double seconds = (double)parse_u64(argv[1], "seconds");
	/* PID may be a shell that runs the timer as its child (a background shell function):
	 * follow the first child down to the vmtool process, for up to a second. */
	char pid[32], path[100], buf[256];
	snprintf(pid, sizeof(pid), "%s", argv[0]);
	for (int tries = 0; tries < 50; tries++) {
		snprintf(path, sizeof(path), "/proc/%s/comm", pid);
		if (read_small(path, buf, sizeof(buf)) && strcmp(buf, "vmtool\n") == 0)
			break;
		snprintf(path, sizeof(path), "/proc/%s/task/%s/children", pid, pid);
		if (read_small(path, buf, sizeof(buf)) && buf[0] >= '1' && buf[0] <= '9')
			snprintf(pid, sizeof(pid), "%.*s", (int)strspn(buf, "0123456789"), buf);
		else
			usleep(20000);
	}
	if (mlockall(MCL_CURRENT | MCL_FUTURE))
		perror("vmtool stalls: mlockall");
	struct sched_param sp = { .sched_priority = 40 };
	if (sched_setscheduler(0, SCHED_FIFO, &sp))
		perror("vmtool stalls: SCHED_FIFO");
	char stat_path[64], stack_path[64];
	snprintf(stat_path, sizeof(stat_path), "/proc/%s/stat", pid);
	snprintf(stack_path, sizeof(stack_path), "/proc/%s/stack", pid);
	static char stat[1024], stack[4096];
	/* Each distinct state and stack of the episode: when first seen, how many samples (20 ms
	 * each: the time spent there), the requests in flight then and at most since. */
	static char seen[STALL_STACKS][480];
	static char seen_state[STALL_STACKS];
	static double seen_at[STALL_STACKS];
	static int seen_samples[STALL_STACKS];
	static char seen_inflight[STALL_STACKS][80];
	static unsigned long seen_max_reads[STALL_STACKS], seen_max_writes[STALL_STACKS];
	int nseen = 0, episodes = 0, threads_printed = 0, log_fd = -1, dumps = 0;
	double start = now_s(), began = -1;
	while (now_s() - start < seconds) {
		usleep(20000);
		double t = now_s();
		backtrace_running_refill(&log_fd, &dumps, t - start);
		if (!read_small(stat_path, stat, sizeof(stat)))
			break; /* PID is gone */
		char *rest = strrchr(stat, ')');
		char state = rest && rest[1] ? rest[2] : '?';
		char frames[480] = "";
		if (read_small(stack_path, stack, sizeof(stack)))
			stack_line(stack, frames, sizeof(frames));
		int asleep = state == 'S' && strstr(frames, "nanosleep");
		if (asleep || t - start >= seconds) {
			if (began >= 0 && t - began >= 1.0 && episodes < STALL_EPISODES) {
				episodes++;
				printf("STALL at %.1f s for %.0f ms:\n", began - start,
				       (t - began) * 1000.0);
				for (int i = 0; i < nseen; i++)
					printf("  +%.0f ms, %d samples, %c [in flight then %s; ublkb0 at "
					       "most %lu/%lu] %s\n",
					       seen_at[i] * 1000.0, seen_samples[i], seen_state[i],
					       seen_inflight[i], seen_max_reads[i], seen_max_writes[i],
					       seen[i]);
				fflush(stdout);
			}
			began = -1;
			nseen = 0;
			continue;
		}
		if (began < 0)
			began = t;
		unsigned long reads, writes, zram_reads, zram_writes;
		int on_ublk = inflight_of("ublkb0", &reads, &writes);
		int on_zram = inflight_of("zram0", &zram_reads, &zram_writes);
		int i = 0;
		while (i < nseen && !(seen_state[i] == state && strcmp(seen[i], frames) == 0))
			i++;
		if (i == nseen && nseen < STALL_STACKS) {
			memcpy(seen[i], frames, sizeof(frames));
			seen_state[i] = state;
			seen_at[i] = t - began;
			seen_samples[i] = 0;
			snprintf(seen_inflight[i], sizeof(seen_inflight[i]),
				 on_ublk ? "ublkb0 %lu/%lu" : "ublkb0 -", reads, writes);
			snprintf(seen_inflight[i] + strlen(seen_inflight[i]),
				 sizeof(seen_inflight[i]) - strlen(seen_inflight[i]),
				 on_zram ? " zram0 %lu/%lu" : " zram0 -", zram_reads, zram_writes);
			seen_max_reads[i] = seen_max_writes[i] = 0;
			nseen++;
		}
		if (i < nseen) {
			seen_samples[i]++;
			if (reads > seen_max_reads[i])
				seen_max_reads[i] = reads;
			if (writes > seen_max_writes[i])
				seen_max_writes[i] = writes;
		}
		if (!threads_printed && t - began >= 1.5) {
			threads_printed = 1;
			printf("STALL at %.1f s, 1.5 s in: the daemon's threads:\n", began - start);
			print_daemon_threads();
			fflush(stdout);
		}
	}
	return 0;
}

static int cmd_rss_settle(int argc, char **argv)
{
	if (argc != 3) {
		fprintf(stderr, "usage: vmtool rss-settle PID LIMIT_KB TIMEOUT_S\n");
		return 2;
	}
	char path[64], buf[4096];
	snprintf(path, sizeof(path), "/proc/%s/status", argv[0]);
	long long limit = (long long)parse_u64(argv[1], "limit");
	double timeout = (double)parse_u64(argv[2], "timeout");
	double t0 = now_s(), settled = -1;
	long long rss = -1;
	for (;;) {
		int fd = open(path, O_RDONLY);
		ssize_t n = fd >= 0 ? read(fd, buf, sizeof(buf) - 1) : -1;
		if (fd >= 0)
			close(fd);
		buf[n > 0 ? n : 0] = 0;
		rss = field_of(buf, "VmRSS");
		double t = now_s() - t0;
		if (rss >= 0 && rss <= limit) {
			settled = t;
			break;
		}
		if (t > timeout)
			break;
		usleep(20000);
	}
	printf("RSS_SETTLE_S=%.2f\nRSS_SETTLE_KB=%lld\n", settled, rss);
	return settled >= 0 ? 0 : 1;
}

static const char *io_result_name(long res, const uint64_t *got, const uint64_t *want)
{
	if (res == -EIO)
		return "EIO";
	if (res < 0)
		return "error";
	if (res != PAGE_BYTES || memcmp(got, want, PAGE_BYTES) != 0)
		return "bad";
	return "ok";
}

static int cmd_bitflip(int argc, char **argv)
{
	enum { PAGES = 8, BAD = 3 };
	if (argc != 2) {
		fprintf(stderr, "usage: vmtool bitflip DEV KEY\n");
		return 2;
	}
	int fd = open(argv[0], O_RDWR | O_DIRECT);
	int shm = shmget((key_t)parse_u64(argv[1], "key"), 0, 0);
	if (fd < 0 || shm < 0) {
		perror("vmtool bitflip: open or shmget");
		return 2;
	}
	uint64_t *want = aligned_alloc(PAGE_BYTES, PAGES * PAGE_BYTES);
	uint64_t *got = aligned_alloc(PAGE_BYTES, PAGES * PAGE_BYTES);
	if (!want || !got)
		return 2;
	uint64_t state = (uint64_t)now_s() * 1000003u;
	for (int i = 0; i < PAGES * PAGE_WORDS; i++)
		want[i] = splitmix64(&state);
	if (pwrite(fd, want, PAGES * PAGE_BYTES, 0) != PAGES * PAGE_BYTES) {
		perror("vmtool bitflip: write");
		return 2;
	}
	sleep(1);

	struct shmid_ds ds;
	unsigned char *seg = shmat(shm, NULL, 0);
	if (seg == (void *)-1 || shmctl(shm, IPC_STAT, &ds) < 0) {
		perror("vmtool bitflip: shmat");
		return 2;
	}
	size_t len = ds.shm_segsz / PAGE_BYTES * PAGE_BYTES;
	unsigned char *resident = malloc(len / PAGE_BYTES);
	if (!resident || mincore(seg, len, resident) < 0) {
		perror("vmtool bitflip: mincore");
		return 2;
	}
	const unsigned char *page3 = (const unsigned char *)(want + BAD * PAGE_WORDS);
	int copies = 0;
	/* A stored raw page may start anywhere in a chunk: look for its first 64 bytes at
	 * every 8-byte step of each resident page (reading a hole would fill it). */
	for (size_t p = 0; p < len / PAGE_BYTES; p++) {
		if (!(resident[p] & 1))
			continue;
		for (size_t off = 0; off + 64 <= PAGE_BYTES; off += 8) {
			unsigned char *at = seg + p * PAGE_BYTES + off;
			if (memcmp(at, page3, 64) != 0)
				continue;
			at[32] ^= 0x10;
			copies++;
		}
	}
	printf("BITFLIP_COPIES=%d\n", copies);

	aio_context_t ctx = 0;
	if (syscall(SYS_io_setup, PAGES, &ctx) < 0) {
		perror("vmtool bitflip: io_setup");
		return 2;
	}
	struct iocb cbs[PAGES], *list[PAGES];
	memset(cbs, 0, sizeof(cbs));
	memset(got, 0, PAGES * PAGE_BYTES);
	for (int i = 0; i < PAGES; i++) {
		cbs[i].aio_fildes = (uint32_t)fd;
		cbs[i].aio_lio_opcode = IOCB_CMD_PREAD;
		cbs[i].aio_buf = (uint64_t)(uintptr_t)(got + i * PAGE_WORDS);
		cbs[i].aio_nbytes = PAGE_BYTES;
		cbs[i].aio_offset = (int64_t)i * PAGE_BYTES;
		cbs[i].aio_data = (uint64_t)i;
		list[i] = &cbs[i];
	}
	if (syscall(SYS_io_submit, ctx, PAGES, list) != PAGES) {
		perror("vmtool bitflip: io_submit");
		return 2;
	}
	long results[PAGES];
	struct io_event events[PAGES];
	int done = 0;
	while (done < PAGES) {
		long n = syscall(SYS_io_getevents, ctx, 1, PAGES - done, events, NULL);
		if (n < 0) {
			perror("vmtool bitflip: io_getevents");
			return 2;
		}
		for (long e = 0; e < n; e++)
			results[events[e].data] = (long)events[e].res;
		done += (int)n;
	}
	syscall(SYS_io_destroy, ctx);
	int right = 1;
	printf("BITFLIP_PAGES=");
	for (int i = 0; i < PAGES; i++) {
		const char *name = io_result_name(results[i], got + i * PAGE_WORDS, want + i * PAGE_WORDS);
		printf("%s%s", i ? " " : "", name);
		if ((i < BAD && strcmp(name, "ok") != 0) || (i == BAD && strcmp(name, "EIO") != 0))
			right = 0;
	}
	printf("\n");
	long alone = pread(fd, got, PAGE_BYTES, (BAD + 1) * PAGE_BYTES);
	const char *alone_name = io_result_name(alone < 0 ? -errno : alone, got, want + (BAD + 1) * PAGE_WORDS);
	printf("BITFLIP_ALONE=%s\n", alone_name);
	return right && copies > 0 && strcmp(alone_name, "ok") == 0 ? 0 : 1;
}

int main(int argc, char **argv)
{
	if (argc >= 2 && strcmp(argv[1], "now") == 0) {
		printf("%.6f\n", now_s());
		return 0;
	}
	if (argc >= 2 && strcmp(argv[1], "clock") == 0) {
		struct timespec ts;
		clock_gettime(CLOCK_REALTIME, &ts);
		printf("%.6f\n", (double)(ts.tv_sec % 86400) + (double)ts.tv_nsec / 1e9);
		return 0;
	}
	if (argc >= 2 && strcmp(argv[1], "gen") == 0)
		return cmd_gen(argc - 2, argv + 2);
	if (argc >= 2 && strcmp(argv[1], "pressure") == 0)
		return cmd_pressure(argc - 2, argv + 2);
	if (argc >= 2 && strcmp(argv[1], "scatter") == 0)
		return cmd_scatter(argc - 2, argv + 2);
	if (argc >= 2 && strcmp(argv[1], "monitor") == 0)
		return cmd_monitor(argc - 2, argv + 2);
	if (argc >= 2 && strcmp(argv[1], "notify-run") == 0)
		return cmd_notify_run(argc - 2, argv + 2);
	if (argc >= 2 && strcmp(argv[1], "job") == 0)
		return cmd_job(argc - 2, argv + 2);
	if (argc >= 2 && strcmp(argv[1], "heartbeat") == 0)
		return cmd_heartbeat(argc - 2, argv + 2);
	if (argc >= 2 && strcmp(argv[1], "shm-remove") == 0)
		return cmd_shm_remove(argc - 2, argv + 2);
	if (argc >= 2 && strcmp(argv[1], "bitflip") == 0)
		return cmd_bitflip(argc - 2, argv + 2);
	if (argc >= 2 && strcmp(argv[1], "pageout") == 0)
		return cmd_pageout(argc - 2, argv + 2);
	if (argc >= 2 && strcmp(argv[1], "pageout-pid") == 0)
		return cmd_pageout_pid(argc - 2, argv + 2);
	if (argc >= 2 && strcmp(argv[1], "wakeup") == 0)
		return cmd_wakeup(argc - 2, argv + 2);
	if (argc >= 2 && strcmp(argv[1], "stalls") == 0)
		return cmd_stalls(argc - 2, argv + 2);
	if (argc >= 2 && strcmp(argv[1], "rss-settle") == 0)
		return cmd_rss_settle(argc - 2, argv + 2);
	fprintf(stderr, "usage: vmtool now | clock | gen BYTES SEED | pressure MIB SEED [HOLDFILE] | "
			"scatter MIB PROCS SEED | "
			"notify-run TIMEOUT_S STATEFILE CMD [ARGS...] | job CMD [ARGS...] | "
			"heartbeat DEV OFFSET STOPFILE | "
			"shm-remove KEY | bitflip DEV KEY | pageout MIB SEED | pageout-pid PID | wakeup PERIOD_MS SECONDS | stalls PID SECONDS | "
			"rss-settle PID LIMIT_KB TIMEOUT_S | "
			"monitor INTERVAL_S DEADLINE_S STALL_S FLAGFILE\n");
	return 2;
}
