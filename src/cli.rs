//! Command-line parsing and output. Every command's work lives in its own module; this file
//! only turns arguments into calls and errors into one or two lines and an exit code.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

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
    /// Benchmark the page store on a corpus of pages (and kernel zram with --compare-zram).
    Bench(crate::bench::BenchArgs),
    /// Enable /dev/ublkbN as swap with discard and the configured priority (without systemd;
    /// under systemd the generated dev-ublkbN.swap unit does it).
    Swapon(crate::config::SwaponArgs),
}

/// Compression algorithm on the command line.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AlgorithmArg {
    Lz4,
    Zstd,
    Adaptive,
}

/// Batch backend on the command line (`auto` selects by batch size).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum BackendArg {
    Auto,
    Simd,
    SimdParallel,
    Gpu,
}

/// Options of the page store, shared by `create` and `bench`. `None` means "from the config
/// file, else the default", so a config file can fill what the command line leaves out.
#[derive(Clone, Debug, Default, Args)]
pub struct StoreArgs {
    /// Compression algorithm [default: zstd]
    #[arg(long, value_enum)]
    pub algorithm: Option<AlgorithmArg>,
    /// zstd level when the algorithm is zstd or adaptive [default: 1]
    #[arg(long)]
    pub zstd_level: Option<i32>,
    /// Batch backend [default: auto]
    #[arg(long, value_enum)]
    pub backend: Option<BackendArg>,
    /// Pending pages that trigger a batch flush [default: 256, or 1000 with the GPU backend]
    #[arg(long)]
    pub batch_threshold: Option<usize>,
    /// Age in ms of the oldest pending page that triggers a flush [default: 10]
    #[arg(long)]
    pub flush_timeout_ms: Option<u64>,
    /// Compress every write in its own thread instead of batching
    #[arg(long)]
    pub no_batched: bool,
    /// Memory limit for stored pages (K/M/G/T suffixes); writes beyond it fail with ENOSPC
    #[arg(long, value_parser = parse_size)]
    pub mem_limit: Option<u64>,
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
    /// Read device settings from this config file (section for --id)
    #[arg(long)]
    pub config: Option<PathBuf>,
    #[command(flatten)]
    pub store: StoreArgs,
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

/// Parse a size with an optional K/M/G/T suffix (powers of 1024; `KiB`/`KB` spellings and
/// lower case accepted), rounded up to a multiple of 4 KiB. Zero is rejected.
pub fn parse_size(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let digits_end = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (digits, suffix) = text.split_at(digits_end);
    if digits.is_empty() {
        return Err(format!(
            "bad size '{text}': expected a number like 8G or 512M"
        ));
    }
    let number: u64 = digits
        .parse()
        .map_err(|_| format!("bad size '{text}': number too large"))?;
    let shift = match suffix.trim().to_ascii_uppercase().as_str() {
        "" | "B" => 0,
        "K" | "KB" | "KIB" => 10,
        "M" | "MB" | "MIB" => 20,
        "G" | "GB" | "GIB" => 30,
        "T" | "TB" | "TIB" => 40,
        other => {
            return Err(format!(
                "bad size '{text}': unknown suffix '{other}' (use K, M, G or T)"
            ))
        }
    };
    let bytes = number
        .checked_mul(1u64 << shift)
        .and_then(|b| b.checked_add(4095))
        .map(|b| b & !4095)
        .ok_or_else(|| format!("bad size '{text}': too large"))?;
    if bytes == 0 {
        return Err(format!("bad size '{text}': must be greater than zero"));
    }
    Ok(bytes)
}

/// Format bytes the way zramctl does: 1.5G, 256M, 4K, 0B.
pub fn human_size(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "K", "M", "G", "T"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit < UNITS.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 || value >= 100.0 || value.fract() == 0.0 {
        format!("{value:.0}{}", UNITS[unit])
    } else {
        format!("{:.1}{}", value, UNITS[unit])
    }
}

/// Run the command line; returns the process exit code. Errors are printed as one or two
/// lines, without a backtrace.
pub fn main() -> i32 {
    let cli = Cli::parse();
    let result: Result<(), Box<dyn std::error::Error>> = match cli.command {
        Command::Create(args) => crate::daemon::create(args).map_err(Into::into),
        Command::List(args) => crate::devices::list(&args).map_err(Into::into),
        Command::Delete(args) => crate::devices::delete(&args).map_err(Into::into),
        Command::Stat(args) => crate::stats::stat(&args).map_err(Into::into),
        Command::Bench(args) => crate::bench::run(&args).map_err(Into::into),
        Command::Swapon(args) => crate::config::swapon(&args).map_err(Into::into),
    };
    match result {
        Ok(()) => 0,
        Err(error) => {
            eprintln!("trueno-ublk: {error}");
            1
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_suffixes_and_round_to_pages() {
        let cases: &[(&str, Result<u64, ()>)] = &[
            ("8G", Ok(8 << 30)),
            ("1g", Ok(1 << 30)),
            ("512M", Ok(512 << 20)),
            ("512MiB", Ok(512 << 20)),
            ("4K", Ok(4096)),
            ("1T", Ok(1 << 40)),
            ("1", Ok(4096)),
            ("5000", Ok(8192)),
            ("0", Err(())),
            ("0G", Err(())),
            ("", Err(())),
            ("G", Err(())),
            ("12X", Err(())),
            ("-1G", Err(())),
            ("99999999999999999999", Err(())),
            ("16777216T", Err(())),
        ];
        for (text, want) in cases {
            assert_eq!(
                parse_size(text).map_err(|_| ()),
                *want,
                "parse_size({text:?})"
            );
        }
    }

    #[test]
    fn human_sizes_read_like_zramctl() {
        assert_eq!(human_size(0), "0B");
        assert_eq!(human_size(4096), "4K");
        assert_eq!(human_size(1536 << 20), "1.5G");
        assert_eq!(human_size(8 << 30), "8G");
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
        assert_eq!(args.store.algorithm, Some(AlgorithmArg::Zstd));
        assert_eq!(args.store.batch_threshold, Some(500));
        assert_eq!(args.store.flush_timeout_ms, Some(5));
        assert_eq!(args.store.mem_limit, Some(1 << 30));
        assert_eq!(args.store.backend, Some(BackendArg::SimdParallel));
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
    fn bad_size_is_a_parse_error() {
        assert!(Cli::try_parse_from(["trueno-ublk", "create", "--size", "0"]).is_err());
        assert!(Cli::try_parse_from(["trueno-ublk", "create", "--size", "lots"]).is_err());
    }
}
