//! The command line: every option a user types and every line the program prints. Each
//! command's work lives in its own module; this file turns arguments into calls, and results
//! and errors into lines and an exit code.

#![forbid(unsafe_code)]

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};

use clap::builder::{PossibleValuesParser, TypedValueParser};
use clap::{Args, Parser, Subcommand};

use crate::bench::{self, BenchOptions, Progress};
use crate::config::{
    AlgorithmChoice, BackendChoice, Choice, DeviceOptions, MemLimit, RecompressChoice, StoreOptions,
};
use crate::daemon::CreateRole;
use crate::devices::DeviceRow;
use crate::stats::StatFormat;
use crate::units::{human_size, parse_duration, parse_size};

/// trueno-ublk: a compressed-RAM block device for swap, served in user space through ublk.
#[derive(Debug, Parser)]
#[command(name = "trueno-ublk", version, about, propagate_version = true)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Create a device (/dev/ublkbN) and serve it; returns once the device is live.
    Create(CreateArgs),
    /// List ublk devices: id, path, size, queues, depth, state, daemon pid.
    List(ListArgs),
    /// Stop and delete devices (refuses a device in use, e.g. active swap, unless --force).
    #[command(alias = "reset")]
    Delete(DeleteArgs),
    /// Show live statistics of running devices (zramctl's columns and more).
    Stat(StatArgs),
    /// Compact a device's store now: move compressed pages out of sparse chunks and free
    /// those (what a store with recompression does by itself), and wait until it is done.
    Compact(CompactArgs),
    /// Take the binary now on disk into use for a device without it ever waiting for a process
    /// to start (after an upgrade; what `systemctl reload trueno-ublk@N` does): a standby of
    /// it takes the device over from the serving process. Waits until it has.
    Reload(ReloadArgs),
    /// Benchmark the page store on a corpus of pages (and kernel zram with --compare-zram). With
    /// recompression on, it then waits for every page to go idle and be recompressed (bounded)
    /// and reports the memory ratio then and right after the writes.
    Bench(BenchArgs),
    /// Enable /dev/ublkbN as swap with discard and the configured priority (without systemd;
    /// under systemd the generated dev-ublkbN.swap unit does it).
    Swapon(SwaponArgs),
    /// Read a process's swapped-out pages back into its memory (PID 1 unless --pid), but only
    /// while every ublk device is served. The unit runs it before a stop: PID 1 starts the next
    /// daemon while the device waits, and must not wait on a page of its own there.
    FaultIn(FaultInArgs),
}

/// A clap parser for a setting with named values: the names are the config file's, in any
/// case as there (its arguments say `ignore_case`).
fn choice<T: Choice>() -> impl TypedValueParser<Value = T> {
    PossibleValuesParser::new(T::names())
        .try_map(|name| T::from_name(&name).ok_or_else(|| format!("unknown value '{name}'")))
}

/// Options of the page store, shared by `create` and `bench`. `None` means "from the config
/// file, else the default", so a config file can fill what the command line leaves out.
#[derive(Clone, Debug, Default, Args)]
pub struct StoreArgs {
    /// Compression algorithm of new pages [default: lz4; with recompression on, zstd while
    /// memory is short]
    #[arg(long, ignore_case = true, value_parser = choice::<AlgorithmChoice>())]
    pub algorithm: Option<AlgorithmChoice>,
    /// zstd level when the algorithm is zstd (adaptive always uses level 1) [default: 1]
    #[arg(long, allow_negative_numbers = true)]
    pub zstd_level: Option<i32>,
    /// Batch backend [default: auto]
    #[arg(long, ignore_case = true, value_parser = choice::<BackendChoice>())]
    pub backend: Option<BackendChoice>,
    /// Pending pages that trigger a batch flush [default: 256, or 1000 with the GPU backend]
    #[arg(long)]
    pub batch_threshold: Option<usize>,
    /// Age in ms of the oldest pending page that triggers a flush [default: 10]
    #[arg(long)]
    pub flush_timeout_ms: Option<u64>,
    /// Compress every write in its own thread instead of batching
    #[arg(long)]
    pub no_batched: bool,
    /// Memory limit for stored pages: a size (K/M/G/T suffixes), a share of RAM (`ram / 4`,
    /// `ram * 0.25`) or `none` (no limit, over the config file's); writes beyond it fail with
    /// ENOSPC
    #[arg(long, value_name = "SIZE", value_parser = MemLimit::parse)]
    pub mem_limit: Option<MemLimit>,
    /// Recompress idle pages in the background (and, for lz4, compress new pages with it while
    /// memory is short): zstd, zstd:LEVEL, or off [default: zstd:3 for lz4 and adaptive, off
    /// for zstd]
    #[arg(long, value_name = "CODEC", value_parser = RecompressChoice::parse)]
    pub recompress: Option<RecompressChoice>,
    /// How long a page goes unread and unwritten before it is recompressed (ms, s, m, h, d)
    /// [default: 30s]
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub recompress_idle: Option<std::time::Duration>,
}

impl StoreArgs {
    pub fn options(&self) -> StoreOptions {
        StoreOptions {
            algorithm: self.algorithm,
            zstd_level: self.zstd_level,
            backend: self.backend,
            batch_threshold: self.batch_threshold,
            flush_timeout_ms: self.flush_timeout_ms,
            no_batched: self.no_batched,
            mem_limit: self.mem_limit,
            recompress: self.recompress,
            recompress_idle: self.recompress_idle,
        }
    }
}

#[derive(Clone, Debug, Args)]
pub struct CreateArgs {
    /// Device size (K/M/G/T suffixes, rounded up to 4 KiB), e.g. 8G
    #[arg(long, value_parser = parse_size)]
    pub size: Option<u64>,
    /// Device id N for /dev/ublkbN [default: the kernel picks]
    #[arg(long)]
    pub id: Option<u32>,
    /// Number of hardware queues (one thread each) [default: 1]
    #[arg(long)]
    pub queues: Option<u16>,
    /// Queue depth (tags per queue) [default: 32]
    #[arg(long)]
    pub depth: Option<u16>,
    /// Stay attached; with NOTIFY_SOCKET set, send READY=1 once the device is live
    #[arg(long)]
    pub foreground: bool,
    /// Internal: be the process that serves the device, started by the one that supervises it
    #[arg(long, hide = true)]
    pub serve_child: bool,
    /// Internal: with --serve-child, be ready to take the device over when told
    #[arg(long, hide = true, requires = "serve_child")]
    pub standby: bool,
    /// Read device settings from this config file (section for --id)
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Hear of freed swap slots only through discards (whole free clusters), without the
    /// kernel probe that frees a slot's memory as swap frees the slot
    #[arg(long)]
    pub no_slot_free_probe: bool,
    /// Give every tag a buffer the kernel copies request data to and from, instead of
    /// moving the data with pread/pwrite on the char device (UBLK_F_USER_COPY, Linux 6.5+)
    #[arg(long)]
    pub no_user_copy: bool,
    /// Never ask the kernel's OOM killer to act when writes starve for memory while swapped
    /// pages do not compress (writes then fail with ENOMEM)
    #[arg(long)]
    pub no_oom_kill: bool,
    #[command(flatten)]
    pub store: StoreArgs,
}

impl CreateArgs {
    pub fn options(&self) -> DeviceOptions {
        DeviceOptions {
            size: self.size,
            id: self.id,
            queues: self.queues,
            depth: self.depth,
            config: self.config.clone(),
            store: self.store.options(),
            no_slot_free_probe: self.no_slot_free_probe,
            no_user_copy: self.no_user_copy,
            no_oom_kill: self.no_oom_kill,
        }
    }
}

#[derive(Clone, Debug, Args)]
pub struct ListArgs {
    /// Print JSON
    #[arg(long)]
    pub json: bool,
}

#[derive(Clone, Debug, Args)]
pub struct DeleteArgs {
    /// Device id to delete
    #[arg(long, conflicts_with = "all", required_unless_present = "all")]
    pub id: Option<u32>,
    /// Delete every ublk device
    #[arg(long)]
    pub all: bool,
    /// Run swapoff first if the device is active swap (nothing is deleted if it fails)
    #[arg(long)]
    pub force: bool,
    /// Delete even a device that is in use while no daemon serves it (one that cannot be
    /// resumed): I/O waiting on it fails, and processes with pages on it may die
    #[arg(long)]
    pub lose_pages: bool,
}

#[derive(Clone, Debug, Args)]
pub struct StatArgs {
    /// Only this device
    #[arg(long)]
    pub id: Option<u32>,
    /// Print JSON
    #[arg(long, conflicts_with = "raw")]
    pub json: bool,
    /// Print sizes in bytes
    #[arg(long)]
    pub raw: bool,
}

#[derive(Clone, Debug, Args)]
pub struct CompactArgs {
    /// Device id N of /dev/ublkbN
    #[arg(long)]
    pub id: u32,
    /// How long to wait for the compaction to finish (it goes on after that)
    #[arg(long, value_name = "DURATION", value_parser = parse_duration, default_value = "60s")]
    pub timeout: std::time::Duration,
}

#[derive(Clone, Debug, Args)]
pub struct ReloadArgs {
    /// Device id N of /dev/ublkbN
    #[arg(long)]
    pub id: u32,
    /// How long to wait for the new process to serve the device
    // Longer than the supervisor's limit for the standby to be ready (60 s,
    // `daemon::RELOAD_READY_LIMIT`), so that a standby not ready in time is said with the
    // supervisor's reason, not as this command's own time-out.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration, default_value = "70s")]
    pub timeout: std::time::Duration,
}

impl StatArgs {
    pub fn format(&self) -> StatFormat {
        match (self.json, self.raw) {
            (true, _) => StatFormat::Json,
            (false, true) => StatFormat::RawTable,
            (false, false) => StatFormat::Table,
        }
    }
}

#[derive(Clone, Debug, Args)]
pub struct BenchArgs {
    /// Corpus file of 4 KiB pages (scripts/make-corpus.sh) [default: a built-in realistic mix]
    #[arg(long)]
    pub input: Option<PathBuf>,
    /// Bytes of pages: the size of the built-in mix [default: 256M], or the first SIZE bytes of
    /// --input [default: all of it]
    #[arg(long, value_parser = parse_size)]
    pub size: Option<u64>,
    /// Writer and reader threads, like the daemon's queue threads [default: number of cores]
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..))]
    pub threads: Option<u16>,
    /// Bytes per write and read request to the store (4K = one page, as swap mostly does)
    #[arg(long, value_parser = parse_size, default_value_t = bench::DEFAULT_REQUEST_BYTES)]
    pub request_size: u64,
    /// Overwrite the whole corpus this many times in random order, then report the memory
    /// ratio again (0 skips it)
    #[arg(long, default_value_t = bench::DEFAULT_OVERWRITES)]
    pub overwrites: u32,
    /// Samples of each single-page latency; the 1000-page batch figures take a tenth as many
    #[arg(long, default_value_t = bench::DEFAULT_LATENCY_SAMPLES, value_parser = clap::value_parser!(u32).range(1..))]
    pub latency_samples: u32,
    /// Rounds of the store's write and read, the codec alone and zram, back to back; the best
    /// figure of each counts (other work on a shared machine only ever slows a run down)
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..))]
    pub repeat: u16,
    /// Seed of the built-in mix and of the random orders
    #[arg(long, default_value_t = bench::DEFAULT_SEED)]
    pub seed: u64,
    /// Print one JSON object instead of the text report
    #[arg(long)]
    pub json: bool,
    /// Also run kernel zram on the same pages: needs root and the zram module; the bench adds
    /// a zram device of its own and removes it after (zram0 only where none can be added, and
    /// only if it is not set up)
    #[arg(long)]
    pub compare_zram: bool,
    /// zram's compression algorithm for --compare-zram (one of /sys/block/zramN/comp_algorithm:
    /// lzo-rle is the kernel's default)
    #[arg(long, default_value = bench::DEFAULT_ZRAM_ALGORITHM)]
    pub zram_algorithm: String,
    /// Parallel O_DIRECT streams for zram (1 = one dd); zram compresses in the thread that
    /// writes, so each stream is a core's worth [default: as many as the store's writer
    /// threads (--threads)]
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..))]
    pub zram_streams: Option<u16>,
    #[command(flatten)]
    pub store: StoreArgs,
}

impl BenchArgs {
    pub fn options(&self) -> BenchOptions {
        BenchOptions {
            input: self.input.clone(),
            size: self.size,
            threads: self.threads,
            request_size: self.request_size,
            overwrites: self.overwrites,
            latency_samples: self.latency_samples,
            repeat: self.repeat,
            seed: self.seed,
            compare_zram: self.compare_zram,
            zram_streams: self.zram_streams,
            zram_algorithm: self.zram_algorithm.clone(),
            store: self.store.options(),
        }
    }
}

/// `trueno-ublk swapon`: swapon with the configured priority, for use without systemd (the
/// units leave swapon to the generated `dev-ublkbN.swap`).
#[derive(Clone, Debug, Args)]
pub struct SwaponArgs {
    /// Device id N of /dev/ublkbN
    #[arg(long)]
    pub id: u32,
    /// Config file whose [ublkbN] section gives swap-priority (100 without one; only
    /// /etc/trueno-ublk.conf may be missing)
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Print the swapon command instead of running it
    #[arg(long)]
    pub dry_run: bool,
}

/// `trueno-ublk fault-in`.
#[derive(Clone, Debug, Args)]
pub struct FaultInArgs {
    /// The process whose pages to bring back
    #[arg(long, default_value_t = 1)]
    pub pid: u32,
}

type CommandResult = Result<(), Box<dyn std::error::Error>>;

/// Run the command line; returns the process exit code. Errors are printed as one or two
/// lines, without a backtrace.
pub fn main() -> i32 {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Create(args) => {
            let role = match (args.serve_child, args.standby, args.foreground) {
                (true, true, _) => CreateRole::Standby,
                (true, false, _) => CreateRole::Serve,
                (false, _, true) => CreateRole::Supervise,
                (false, _, false) => CreateRole::Detach,
            };
            crate::daemon::create(&args.options(), role).map_err(Into::into)
        }
        Command::List(args) => list(&args),
        Command::Delete(args) => delete(&args),
        Command::Stat(args) => stat(&args),
        Command::Compact(args) => compact(&args),
        Command::Reload(args) => reload(&args),
        Command::Bench(args) => run_bench(&args),
        Command::Swapon(args) => swapon(&args),
        Command::FaultIn(args) => fault_in(&args),
    };
    match result {
        Ok(()) => 0,
        Err(error) => {
            crate::os::print_err(&format!("trueno-ublk: {error}"));
            1
        }
    }
}

/// Write `text` to standard output. A reader that has gone (`trueno-ublk stat | head`) ends
/// the output quietly; `print!` would panic there instead.
fn print_out(text: &str) -> CommandResult {
    let mut stdout = std::io::stdout().lock();
    match stdout
        .write_all(text.as_bytes())
        .and_then(|()| stdout.flush())
    {
        Err(error) if error.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        result => Ok(result?),
    }
}

fn list(args: &ListArgs) -> CommandResult {
    let rows = crate::devices::list()?;
    if args.json {
        print_out(&format!("{}\n", serde_json::to_string_pretty(&rows)?))?;
    } else {
        print_out(&device_table(&rows))?;
    }
    Ok(())
}

/// `list`'s table.
fn device_table(rows: &[DeviceRow]) -> String {
    if rows.is_empty() {
        return "no ublk devices\n".to_string();
    }
    let line = |cells: [&str; 7]| {
        format!(
            "{:<4} {:<14} {:>8} {:>6} {:>6} {:<6} {:>8}\n",
            cells[0], cells[1], cells[2], cells[3], cells[4], cells[5], cells[6]
        )
    };
    let mut out = line(["ID", "DEVICE", "SIZE", "QUEUES", "DEPTH", "STATE", "PID"]);
    for row in rows {
        let pid = if row.daemon_alive {
            row.pid.to_string()
        } else {
            format!("{} (gone)", row.pid)
        };
        out.push_str(&line([
            &row.id.to_string(),
            &row.path,
            &human_size(row.size),
            &row.queues.to_string(),
            &row.depth.to_string(),
            row.state,
            &pid,
        ]));
    }
    out
}

fn delete(args: &DeleteArgs) -> CommandResult {
    let target = if args.all { None } else { args.id };
    let mut deleted = 0usize;
    let mut said = |path: &str, note: Option<&str>| {
        deleted += 1;
        // A closed stdout (`| head`) is no reason to stop deleting.
        let _ = print_out(&format!("deleted {path}\n"));
        if let Some(note) = note {
            crate::os::print_err(&format!("trueno-ublk: note: {note}"));
        }
    };
    crate::devices::delete(
        target,
        args.force,
        args.lose_pages,
        &crate::daemon::device_claimed_by,
        &mut said,
    )?;
    if deleted == 0 {
        // `--all` with nothing to delete: say so, as `list` does.
        print_out("no ublk devices\n")?;
    }
    Ok(())
}

fn stat(args: &StatArgs) -> CommandResult {
    // Devices whose I/O waits for a daemon, as the kernel lists them (none where the driver is
    // not loaded or cannot be asked): one that has no socket gets a line too.
    let unserved: Vec<crate::stats::Unserved> = crate::devices::waiting_for_daemon()
        .unwrap_or_default()
        .into_iter()
        .map(|device| crate::stats::Unserved {
            id: device.id,
            state: device.state,
            supervisor: crate::daemon::device_claimed_by(device.id),
        })
        .collect();
    let text = crate::stats::report_text(
        Path::new(crate::stats::SOCKET_DIR),
        args.id,
        args.format(),
        &unserved,
    )?;
    print_out(&text)?;
    Ok(())
}

fn compact(args: &CompactArgs) -> CommandResult {
    let (before, after) =
        crate::stats::compact(Path::new(crate::stats::SOCKET_DIR), args.id, args.timeout)?;
    print_out(&format!(
        "{}: compacted: {} pages moved, memory {} -> {} (TOTAL {} -> {})\n",
        after.device,
        after
            .store
            .compacted_pages
            .saturating_sub(before.store.compacted_pages),
        human_size(before.store.mem_used),
        human_size(after.store.mem_used),
        human_size(before.total_bytes()),
        human_size(after.total_bytes()),
    ))?;
    Ok(())
}

fn reload(args: &ReloadArgs) -> CommandResult {
    let (before, after) =
        crate::stats::reload(Path::new(crate::stats::SOCKET_DIR), args.id, args.timeout)?;
    print_out(&format!(
        "{}: reloaded: served by pid {} (was {})\n",
        after.device, after.pid, before.pid
    ))?;
    Ok(())
}

fn run_bench(args: &BenchArgs) -> CommandResult {
    let progress = if args.json || !std::io::stderr().is_terminal() {
        Progress::hidden()
    } else {
        Progress::on_stderr_after_a_second()
    };
    let options = args.options();
    let corpus = bench::load_corpus(&options)?;
    let report = bench::measure(&options, &corpus, &progress);
    progress.finish();
    let report = report?;
    if report.request_bytes as u64 != options.request_size {
        crate::os::print_err(&format!(
            "trueno-ublk: note: requests of {} bytes, not the {} asked for: a whole number of \
             pages that divides the corpus's {} pages",
            report.request_bytes, options.request_size, report.pages
        ));
    }
    if args.json {
        print_out(&format!("{}\n", serde_json::to_string_pretty(&report)?))?;
    } else {
        print_out(&report.to_text())?;
    }
    Ok(())
}

fn swapon(args: &SwaponArgs) -> CommandResult {
    let priority = crate::swap::priority(args.id, args.config.as_deref())?;
    if args.dry_run {
        print_out(&format!(
            "{}\n",
            crate::swap::swapon_command(args.id, priority).join(" ")
        ))?;
        return Ok(());
    }
    crate::swap::swapon(args.id, priority)?;
    Ok(())
}

fn fault_in(args: &FaultInArgs) -> CommandResult {
    let pid = args.pid;
    let line = match crate::swap::fault_in(pid)? {
        crate::swap::FaultIn::Read {
            swapped,
            still_swapped,
            out_of_reach,
        } => {
            let read = if swapped == 0 {
                format!("pid {pid}: no page swapped out")
            } else {
                format!(
                    "pid {pid}: {swapped} pages were swapped out, {} read back ({still_swapped} out again)",
                    swapped.saturating_sub(still_swapped)
                )
            };
            if out_of_reach == 0 {
                read
            } else {
                format!(
                    "{read}; {out_of_reach} pages of shared memory stay swapped out (not in its \
                     page tables, so not found)"
                )
            }
        }
        crate::swap::FaultIn::NotServed { path, state } => format!(
            "pid {pid}: nothing (more) read back: {path} is not served right now ({state}), and a \
             read of a page on it would wait for its next daemon"
        ),
    };
    print_out(&format!("{line}\n"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::SizeExpr;

    #[test]
    fn reload_waits_past_the_supervisors_limit_for_its_standby() {
        let cli = Cli::try_parse_from(["trueno-ublk", "reload", "--id", "0"]).unwrap();
        let Command::Reload(args) = cli.command else {
            panic!("not reload");
        };
        assert!(args.timeout > crate::daemon::RELOAD_READY_LIMIT);
    }

    #[test]
    fn create_parses_documented_flags() {
        let cli = Cli::try_parse_from([
            "trueno-ublk",
            "create",
            "--size",
            "8G",
            "--id",
            "3",
            "--queues",
            "2",
            "--depth",
            "128",
            "--foreground",
            "--algorithm",
            "zstd",
            "--batch-threshold",
            "500",
            "--flush-timeout-ms",
            "5",
            "--mem-limit",
            "1G",
            "--backend",
            "simd-parallel",
            "--recompress",
            "zstd:5",
            "--recompress-idle",
            "2m",
        ])
        .unwrap();
        let Command::Create(args) = cli.command else {
            panic!("not create")
        };
        assert_eq!(args.size, Some(8 << 30));
        assert_eq!(args.id, Some(3));
        assert_eq!(args.queues, Some(2));
        assert_eq!(args.depth, Some(128));
        assert!(args.foreground);
        assert_eq!(args.store.algorithm, Some(AlgorithmChoice::Zstd));
        assert_eq!(args.store.batch_threshold, Some(500));
        assert_eq!(args.store.flush_timeout_ms, Some(5));
        assert_eq!(
            args.store.mem_limit,
            Some(MemLimit::Size(SizeExpr::Bytes(1 << 30)))
        );
        assert_eq!(args.store.backend, Some(BackendChoice::SimdParallel));
        assert_eq!(
            args.store.recompress,
            Some(RecompressChoice::Zstd { level: 5 })
        );
        assert_eq!(
            args.store.recompress_idle,
            Some(std::time::Duration::from_secs(120))
        );
    }

    #[test]
    fn delete_needs_id_or_all_and_reset_is_an_alias() {
        assert!(Cli::try_parse_from(["trueno-ublk", "delete"]).is_err());
        assert!(Cli::try_parse_from(["trueno-ublk", "delete", "--id", "1", "--all"]).is_err());
        let cli = Cli::try_parse_from(["trueno-ublk", "reset", "--all"]).unwrap();
        assert!(matches!(
            cli.command,
            Command::Delete(DeleteArgs { all: true, .. })
        ));
        let cli = Cli::try_parse_from(["trueno-ublk", "delete", "--id", "0", "--force"]).unwrap();
        assert!(matches!(
            cli.command,
            Command::Delete(DeleteArgs {
                id: Some(0),
                force: true,
                ..
            })
        ));
    }

    #[test]
    fn named_values_take_any_case_as_in_the_file() {
        let cli = Cli::try_parse_from([
            "trueno-ublk",
            "create",
            "--algorithm",
            "ZSTD",
            "--backend",
            "Simd-Parallel",
        ])
        .unwrap();
        let Command::Create(args) = cli.command else {
            panic!("not create")
        };
        assert_eq!(args.store.algorithm, Some(AlgorithmChoice::Zstd));
        assert_eq!(args.store.backend, Some(BackendChoice::SimdParallel));
        assert!(Cli::try_parse_from(["trueno-ublk", "create", "--algorithm", "lzo"]).is_err());
    }

    #[test]
    fn bad_size_is_a_parse_error() {
        assert!(Cli::try_parse_from(["trueno-ublk", "create", "--size", "0"]).is_err());
        assert!(Cli::try_parse_from(["trueno-ublk", "create", "--size", "lots"]).is_err());
    }
}
