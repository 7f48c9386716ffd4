//! Everything a user can set, and the one source of every default and limit: the options as
//! given (command line, without any parser's types), the boot configuration file
//! (`/etc/trueno-ublk.conf`, `file`), and the settings after merging them with the defaults.
//! Precedence: command line > config file > default.
//!
//! The file is INI-like, one `[ublkbN]` section per device, keys named like `create`'s long
//! flags (see `trueno-ublk.conf.example` and the README):
//!
//! ```text
//! [ublkb0]
//! # or 8G; capped by max-size
//! size = ram / 2
//! max-size = 4G
//! algorithm = lz4
//! recompress = zstd:3
//! recompress-idle = 30s
//! swap-priority = 100
//! ```
//!
//! A missing file means defaults for every device; an unknown section or key, or a bad value,
//! is an error naming the file, the line and the key. Without any size the device gets
//! zram-generator's default, min(RAM / 2, 4 GiB), where a `max-size` takes the 4 GiB's place
//! (as zram-generator's `max-zram-size` did).

#![forbid(unsafe_code)]

mod file;
mod values;

use std::path::{Path, PathBuf};
use std::time::Duration;

use thiserror::Error;

use crate::codec::{Algorithm, Backend, BackendThresholds, PAGE_SIZE};
use crate::store::{RecompressConfig, StoreConfig};
use crate::units::human_duration;
pub use file::{load, parse, ConfigFile, DeviceSection, Setting, KEYS};
pub use values::{parse_size_expr, MemLimit, SizeExpr};

/// Where the systemd units read the configuration from.
pub const DEFAULT_CONFIG_PATH: &str = "/etc/trueno-ublk.conf";

/// zram-generator's default device size is min(RAM / 2, this).
pub const DEFAULT_SIZE_CAP: u64 = 4 << 30;
pub const DEFAULT_QUEUES: u16 = 1;
/// Tags per queue: one queue thread serves them in turn, so more tags add little but requests
/// waiting on the daemon (and, without user copy, a locked 64 KiB buffer each).
pub const DEFAULT_DEPTH: u16 = 32;
/// New pages get LZ4 by default, the speed of the hot path; pages idle for
/// `DEFAULT_RECOMPRESS_IDLE` are recompressed with zstd in the background
/// (`DEFAULT_RECOMPRESS`), and while memory is short new pages get that zstd at once
/// (`MEMORY_SHORT_BELOW_DIVISOR`): the VM test's 256 MiB swap storm ran out of memory with LZ4
/// alone (docs/limits.md).
pub const DEFAULT_ALGORITHM: AlgorithmChoice = AlgorithmChoice::Lz4;
/// The zstd level of `--algorithm zstd` (`adaptive` keeps its own, `codec::page::ADAPTIVE_ZSTD_LEVEL`).
pub const DEFAULT_ZSTD_LEVEL: i32 = 1;
/// Idle pages of an LZ4 or adaptive store are recompressed with zstd at this level unless
/// `recompress` says otherwise; a zstd store's are left as they are unless it says so (zstd at
/// a higher level rarely saves the 1/8 a page must save). On real memory pages
/// (scripts/make-corpus.sh) level 3 compresses about as fast as level 1 and 3% smaller; level
/// 5 saves 3% more at half the speed, level 9 4% more at a sixth.
pub const DEFAULT_RECOMPRESS: RecompressChoice = RecompressChoice::Zstd {
    level: DEFAULT_RECOMPRESS_ZSTD_LEVEL,
};
/// The level of `--recompress zstd` without one.
pub const DEFAULT_RECOMPRESS_ZSTD_LEVEL: i32 = 3;
/// A page is recompressed once it has gone this long unread and unwritten: swapped-out pages
/// that come back soon stay at LZ4's speed.
pub const DEFAULT_RECOMPRESS_IDLE: Duration = Duration::from_secs(30);
pub const MIN_RECOMPRESS_IDLE: Duration = Duration::from_millis(100);
pub const MAX_RECOMPRESS_IDLE: Duration = Duration::from_secs(86_400);
/// A recompressed page is kept only if it is at least 1/8 smaller than before: below that, the
/// slower reads of zstd cost more than the memory saves.
pub const RECOMPRESS_MIN_SAVING_DIVISOR: usize = 8;
/// The system counts as short of memory while `MemAvailable` is below RAM / this, until it is
/// back above RAM / `MEMORY_SHORT_UNTIL_DIVISOR`: then an LZ4 store compresses new pages with
/// its recompression codec at once (`store::short_memory_algorithm`), since the pages swap
/// takes then are the ones it cannot give RAM back for. With file cache left to reclaim,
/// swapping pages out is not yet a shortage, and LZ4 keeps swap fast.
pub const MEMORY_SHORT_BELOW_DIVISOR: u64 = 16;
pub const MEMORY_SHORT_UNTIL_DIVISOR: u64 = 8;
/// The recompressor uses at most half of one core (and only CPU that nothing else wants: it
/// runs at nice 19).
pub const RECOMPRESS_CPU_PERCENT: u32 = 50;
/// Pending pages per batch without a GPU: enough for every core to compress a share of each
/// flush, and with two batches only 2 MiB of locked memory (swap wants the RAM back).
pub const DEFAULT_BATCH_THRESHOLD: usize = 256;
/// Pending pages per batch for the GPU backend: the smallest batch it takes (it needs large
/// batches to pay off).
pub const DEFAULT_GPU_BATCH_THRESHOLD: usize = crate::codec::GPU_MIN_BATCH_PAGES;
pub const DEFAULT_FLUSH_TIMEOUT_MS: u64 = 10;
/// zram-generator's default swap priority.
pub const DEFAULT_SWAP_PRIORITY: u16 = 100;

/// Queues and tags per queue a device may have: the ublk layer's limits.
pub use crate::ublk::params::{MAX_DEPTH, MAX_QUEUES};
/// A pending batch holds this many 4 KiB pages at most (256 MiB), to keep memory bounded.
pub const MAX_BATCH_THRESHOLD: usize = 65536;
pub const MAX_FLUSH_TIMEOUT_MS: u64 = 10_000;
/// swapon(8) accepts priorities 0..=32767.
pub const MAX_SWAP_PRIORITY: u16 = 32767;
/// Chunk memory the store keeps ready (see `reserve_bytes`): a share of RAM within these.
const RESERVE_DIVISOR: u64 = 64;
const RESERVE_MIN_BYTES: u64 = 4 << 20;
const RESERVE_MAX_BYTES: u64 = 64 << 20;

#[derive(Debug, Error)]
pub enum ConfigError {
    #[error("cannot read config file {}: {source}", path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}:{line}: {message}", path.display())]
    Syntax {
        path: PathBuf,
        line: usize,
        message: String,
    },
    #[error("{}:{line}: bad value '{value}' for key '{key}': {reason}", path.display())]
    BadValue {
        path: PathBuf,
        line: usize,
        key: String,
        value: String,
        reason: String,
    },
    #[error("{origin}: {key} {reason}")]
    OutOfRange {
        origin: String,
        key: &'static str,
        reason: String,
    },
    #[error("--config {} needs --id N to pick its [ublkbN] section", path.display())]
    NeedsId { path: PathBuf },
    #[error("config file {} does not exist (only {DEFAULT_CONFIG_PATH} may be missing, meaning the defaults)", path.display())]
    Missing { path: PathBuf },
    #[error("cannot read the RAM size from /proc/meminfo ({0}): the default size and the memory the daemon keeps ready depend on it; mount /proc")]
    Meminfo(String),
}

/// A setting with named values (`--algorithm zstd`, `backend = simd`): the names are the same
/// on the command line and in the file.
pub trait Choice: Copy + PartialEq + Send + Sync + 'static {
    /// Every value and its name.
    const NAMES: &'static [(&'static str, Self)];

    /// The value named `name` (any case).
    fn from_name(name: &str) -> Option<Self> {
        Self::NAMES
            .iter()
            .find(|(known, _)| known.eq_ignore_ascii_case(name))
            .map(|&(_, value)| value)
    }

    /// Every name, in order.
    fn names() -> Vec<&'static str> {
        Self::NAMES.iter().map(|&(name, _)| name).collect()
    }
}

/// `--algorithm`, `algorithm =`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AlgorithmChoice {
    Lz4,
    Zstd,
    Adaptive,
}

impl AlgorithmChoice {
    /// The codec's algorithm, with `zstd_level` where zstd is used.
    pub fn with_level(self, zstd_level: i32) -> Algorithm {
        match self {
            Self::Lz4 => Algorithm::Lz4,
            Self::Zstd => Algorithm::Zstd { level: zstd_level },
            Self::Adaptive => Algorithm::Adaptive,
        }
    }
}

impl Choice for AlgorithmChoice {
    const NAMES: &'static [(&'static str, Self)] = &[
        ("lz4", Self::Lz4),
        ("zstd", Self::Zstd),
        ("adaptive", Self::Adaptive),
    ];
}

/// `--recompress`, `recompress =`: `off`, or `zstd[:LEVEL]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecompressChoice {
    Off,
    Zstd { level: i32 },
}

impl RecompressChoice {
    /// `off`, `zstd` (at `DEFAULT_RECOMPRESS_ZSTD_LEVEL`) or `zstd:LEVEL`.
    pub fn parse(text: &str) -> Result<Self, String> {
        let text = text.trim();
        if text.eq_ignore_ascii_case("off") || text.eq_ignore_ascii_case("no") {
            return Ok(Self::Off);
        }
        let (name, level) = match text.split_once(':') {
            Some((name, level)) => (name.trim(), Some(level.trim())),
            None => (text, None),
        };
        if !name.eq_ignore_ascii_case("zstd") {
            return Err(format!(
                "'{text}' is not off, zstd or zstd:LEVEL (pages are recompressed with zstd only)"
            ));
        }
        let level = match level {
            None => DEFAULT_RECOMPRESS_ZSTD_LEVEL,
            Some(level) => values::parse_zstd_level(level)?,
        };
        Ok(Self::Zstd { level })
    }

    /// What `parse` reads back: `off` or `zstd:LEVEL`.
    pub fn name(self) -> String {
        match self {
            Self::Off => "off".to_string(),
            Self::Zstd { level } => format!("zstd:{level}"),
        }
    }

    /// Whether recompressing pages stored with `algorithm` can make them smaller: zstd at a
    /// level no higher than the write path's gains nothing.
    fn can_improve(self, algorithm: Algorithm) -> bool {
        match (self, algorithm) {
            (Self::Off, _) => false,
            (Self::Zstd { .. }, Algorithm::Lz4 | Algorithm::Adaptive) => true,
            (Self::Zstd { level }, Algorithm::Zstd { level: stored }) => level > stored,
        }
    }
}

/// `--backend`, `backend =` (`auto` selects by batch size).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendChoice {
    Auto,
    Simd,
    SimdParallel,
    Gpu,
}

impl BackendChoice {
    /// The backend every batch must use, or `None` to select by batch size.
    pub fn forced(self) -> Option<Backend> {
        match self {
            Self::Auto => None,
            Self::Simd => Some(Backend::Simd),
            Self::SimdParallel => Some(Backend::SimdParallel),
            Self::Gpu => Some(Backend::Gpu),
        }
    }
}

impl Choice for BackendChoice {
    const NAMES: &'static [(&'static str, Self)] = &[
        ("auto", Self::Auto),
        ("simd", Self::Simd),
        ("simd-parallel", Self::SimdParallel),
        ("gpu", Self::Gpu),
    ];
}

/// The page-store options as given on the command line (`create` and `bench`). `None` means
/// "from the config file, else the default".
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StoreOptions {
    pub algorithm: Option<AlgorithmChoice>,
    pub zstd_level: Option<i32>,
    pub backend: Option<BackendChoice>,
    pub batch_threshold: Option<usize>,
    pub flush_timeout_ms: Option<u64>,
    /// `--no-batched`.
    pub no_batched: bool,
    pub mem_limit: Option<MemLimit>,
    pub recompress: Option<RecompressChoice>,
    pub recompress_idle: Option<Duration>,
}

/// The device options as given on the command line (`create`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DeviceOptions {
    pub size: Option<u64>,
    pub id: Option<u32>,
    pub queues: Option<u16>,
    pub depth: Option<u16>,
    /// The config file whose `[ublkb{id}]` section fills what the options leave out.
    pub config: Option<PathBuf>,
    pub store: StoreOptions,
    /// `--no-slot-free-probe`.
    pub no_slot_free_probe: bool,
    /// `--no-user-copy`.
    pub no_user_copy: bool,
    /// `--no-oom-kill`.
    pub no_oom_kill: bool,
}

/// Page-store settings after merging, ready to become a `store::StoreConfig`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoreSettings {
    pub algorithm: Algorithm,
    /// `None`: the store selects a backend by batch size (`--backend auto`).
    pub forced_backend: Option<Backend>,
    pub batched: bool,
    /// `None`: `DEFAULT_BATCH_THRESHOLD`, or `DEFAULT_GPU_BATCH_THRESHOLD` with a GPU codec.
    pub batch_threshold: Option<usize>,
    pub flush_timeout: Duration,
    pub mem_limit: Option<u64>,
    /// Background recompression of idle pages; `None`: off.
    pub recompress: Option<RecompressConfig>,
}

impl StoreSettings {
    /// The store's configuration for a device of `size_bytes`, served with a GPU codec or
    /// without (which sets the default batch size).
    pub fn store_config(&self, size_bytes: u64, with_gpu: bool) -> StoreConfig {
        let default_threshold = if with_gpu {
            DEFAULT_GPU_BATCH_THRESHOLD
        } else {
            DEFAULT_BATCH_THRESHOLD
        };
        StoreConfig {
            algorithm: self.algorithm,
            batched: self.batched,
            batch_threshold: self.batch_threshold.unwrap_or(default_threshold),
            flush_timeout: self.flush_timeout,
            mem_limit: self.mem_limit,
            forced_backend: self.forced_backend,
            thresholds: BackendThresholds::default(),
            reserve_bytes: 0,
            recompress: self.recompress,
            oom_killer: None,
            size_bytes,
        }
    }

    /// The algorithm whose codec contexts the threads that compress new pages make (see
    /// `store::thread_algorithm`).
    pub fn thread_algorithm(&self) -> Algorithm {
        crate::store::thread_algorithm(self.algorithm, self.recompress)
    }

    /// `zstd:3,idle=30s`, or `off` (what `stat` shows as RECOMPRESS).
    pub fn recompress_name(&self) -> String {
        match self.recompress {
            None => "off".to_string(),
            Some(config) => format!("{},idle={}", config.algorithm, human_duration(config.idle)),
        }
    }

    /// `lz4`, `zstd:3` or `adaptive` (what `stat` shows as ALGORITHM).
    pub fn algorithm_name(&self) -> String {
        self.algorithm.to_string()
    }

    /// `auto`, `simd`, `simd-parallel` or `gpu`.
    pub fn backend_name(&self) -> &'static str {
        self.forced_backend.map_or("auto", Backend::name)
    }
}

/// The recompression `choice` and `idle` threshold give for pages stored with `algorithm`.
fn recompress_config(
    choice: RecompressChoice,
    idle: Duration,
    algorithm: Algorithm,
) -> Option<RecompressConfig> {
    match choice {
        RecompressChoice::Off => None,
        RecompressChoice::Zstd { level } => Some(RecompressConfig {
            algorithm: Algorithm::Zstd { level },
            idle,
            min_saving_divisor: RECOMPRESS_MIN_SAVING_DIVISOR,
            cpu_percent: RECOMPRESS_CPU_PERCENT,
        })
        .filter(|_| choice.can_improve(algorithm)),
    }
}

/// The recompression a store of `algorithm` gets when nobody asks for one: `DEFAULT_RECOMPRESS`
/// for LZ4 and adaptive pages, none for zstd pages.
fn default_recompress(algorithm: Algorithm, idle: Duration) -> Option<RecompressConfig> {
    match algorithm {
        Algorithm::Lz4 | Algorithm::Adaptive => {
            recompress_config(DEFAULT_RECOMPRESS, idle, algorithm)
        }
        Algorithm::Zstd { .. } => None,
    }
}

/// Everything `create` needs, after merging command line, config file and defaults.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceSettings {
    /// `None`: the kernel picks the id.
    pub id: Option<u32>,
    /// Device size in bytes, a multiple of 4096.
    pub size_bytes: u64,
    pub queues: u16,
    pub depth: u16,
    pub store: StoreSettings,
    /// Hear of freed swap slots as the kernel frees them (see `crate::slotfree`), where the
    /// kernel allows it.
    pub slot_free_probe: bool,
    /// Move request data with pread/pwrite on the char device (`UBLK_F_USER_COPY`) where the
    /// driver offers it, rather than through a buffer per tag.
    pub user_copy: bool,
    /// Let a store starved near OOM ask the kernel's OOM killer to act (see `store::oom`).
    pub oom_kill: bool,
}

impl Default for StoreSettings {
    /// The product's defaults (what `create` uses when nothing is set).
    fn default() -> Self {
        Self {
            algorithm: DEFAULT_ALGORITHM.with_level(DEFAULT_ZSTD_LEVEL),
            forced_backend: BackendChoice::Auto.forced(),
            batched: true,
            batch_threshold: None,
            flush_timeout: Duration::from_millis(DEFAULT_FLUSH_TIMEOUT_MS),
            mem_limit: None,
            recompress: default_recompress(
                DEFAULT_ALGORITHM.with_level(DEFAULT_ZSTD_LEVEL),
                DEFAULT_RECOMPRESS_IDLE,
            ),
        }
    }
}

impl DeviceSettings {
    /// The store's configuration for this device on a machine with `ram_bytes` of RAM, with a
    /// GPU codec or without; it keeps a chunk reserve (see `reserve_bytes`).
    pub fn store_config(&self, with_gpu: bool, ram_bytes: u64) -> StoreConfig {
        let mut config = self.store.store_config(self.size_bytes, with_gpu);
        config.reserve_bytes = reserve_bytes(ram_bytes, config.mem_limit);
        config
    }
}

/// Chunk memory the store keeps ready so that storing swapped-out pages never waits on
/// reclaim: a sixty-fourth of RAM, between 4 and 64 MiB, and no more than the memory limit.
/// What is held here is locked memory nobody else can use until the store fills it; with the
/// refill thread real-time, 4 MiB kept every write in the VM tests served.
pub fn reserve_bytes(ram_bytes: u64, mem_limit: Option<u64>) -> u64 {
    (ram_bytes / RESERVE_DIVISOR)
        .clamp(RESERVE_MIN_BYTES, RESERVE_MAX_BYTES)
        .min(mem_limit.unwrap_or(u64::MAX))
}

/// Merge `args`, the config file it names (section `[ublkb{id}]`) and the defaults, reading the
/// RAM size from /proc/meminfo.
pub fn resolve(args: &DeviceOptions) -> Result<DeviceSettings, ConfigError> {
    let file = load_for(args.config.as_deref(), args.id)?;
    resolve_with(args, &file, ram_bytes()?)
}

/// Total RAM, for sizes given as a share of it.
pub fn ram_bytes() -> Result<u64, ConfigError> {
    crate::os::ram_bytes().map_err(|error| ConfigError::Meminfo(error.to_string()))
}

/// `resolve` with the file already parsed and the RAM size given (for tests).
pub fn resolve_with(
    args: &DeviceOptions,
    file: &ConfigFile,
    ram_bytes: u64,
) -> Result<DeviceSettings, ConfigError> {
    let empty = DeviceSection::default();
    let section = args.id.and_then(|id| file.device(id)).unwrap_or(&empty);
    let size_bytes = match args.size {
        Some(bytes) => bytes,
        None => config_size(section, file, ram_bytes)?,
    };
    let queues = pick(args.queues, section.queues, DEFAULT_QUEUES);
    let depth = pick(args.depth, section.depth, DEFAULT_DEPTH);
    check_range(
        "queues",
        queues,
        1,
        MAX_QUEUES,
        args.queues.is_some(),
        section.queues,
        file,
    )?;
    check_range(
        "depth",
        depth,
        1,
        MAX_DEPTH,
        args.depth.is_some(),
        section.depth,
        file,
    )?;
    let store = merge_store(&args.store, section, file, ram_bytes)?;
    Ok(DeviceSettings {
        id: args.id,
        size_bytes,
        queues,
        depth,
        store,
        slot_free_probe: switch_on(args.no_slot_free_probe, section.slot_free_probe),
        user_copy: switch_on(args.no_user_copy, section.user_copy),
        oom_kill: switch_on(args.no_oom_kill, section.oom_kill),
    })
}

/// Store settings from the command line and the defaults only (`bench`); a memory limit given
/// as a share of RAM is of this machine's.
pub fn store_settings(args: &StoreOptions) -> Result<StoreSettings, ConfigError> {
    merge_store(
        args,
        &DeviceSection::default(),
        &ConfigFile::default(),
        ram_bytes()?,
    )
}

/// The file `--config` names, for device `id`. The default path may be missing (the units
/// name it, and a machine without one runs on the defaults); any other path must exist, so
/// that a typo in it is not a device silently set up with the defaults.
pub(crate) fn load_for(path: Option<&Path>, id: Option<u32>) -> Result<ConfigFile, ConfigError> {
    match path {
        None => Ok(ConfigFile::default()),
        Some(path) if id.is_none() => Err(ConfigError::NeedsId {
            path: path.to_path_buf(),
        }),
        Some(path)
            if path != Path::new(DEFAULT_CONFIG_PATH) && matches!(path.try_exists(), Ok(false)) =>
        {
            Err(ConfigError::Missing {
                path: path.to_path_buf(),
            })
        }
        Some(path) => load(path),
    }
}

pub(crate) fn pick<T: Copy>(command_line: Option<T>, file: Option<Setting<T>>, default: T) -> T {
    command_line
        .or(file.map(|setting| setting.value))
        .unwrap_or(default)
}

/// A switch that is on unless its `--no-...` flag is given or the file says `no`.
fn switch_on(turned_off: bool, file: Option<Setting<bool>>) -> bool {
    !turned_off && pick(None, file, true)
}

/// Where `key`'s value came from, for a message: the file's line, or the command line when
/// the flag was given (it wins over the file).
fn origin<T>(
    key: &str,
    from_command_line: bool,
    setting: Option<Setting<T>>,
    file: &ConfigFile,
) -> String {
    match setting {
        Some(setting) if !from_command_line => file.origin(setting.line),
        _ => format!("command line (--{key})"),
    }
}

fn check_range<T: PartialOrd + std::fmt::Display>(
    key: &'static str,
    value: T,
    min: T,
    max: T,
    from_command_line: bool,
    setting: Option<Setting<T>>,
    file: &ConfigFile,
) -> Result<(), ConfigError> {
    if value >= min && value <= max {
        return Ok(());
    }
    Err(ConfigError::OutOfRange {
        origin: origin(key, from_command_line, setting, file),
        key,
        reason: format!("is {value}; it must be from {min} to {max}"),
    })
}

fn config_size(
    section: &DeviceSection,
    file: &ConfigFile,
    ram_bytes: u64,
) -> Result<u64, ConfigError> {
    let Some(size) = section.size else {
        let half_ram = SizeExpr::RamFraction {
            numerator: 1,
            denominator: 2,
        };
        let cap = section.max_size.map_or(DEFAULT_SIZE_CAP, |s| s.value);
        let bytes = half_ram.evaluate(ram_bytes).min(cap);
        return non_zero_size(bytes, "default size (RAM / 2)".to_string());
    };
    let mut bytes = size.value.evaluate(ram_bytes);
    if let Some(cap) = section.max_size {
        bytes = bytes.min(cap.value);
    }
    non_zero_size(bytes, file.origin(size.line))
}

fn non_zero_size(bytes: u64, origin: String) -> Result<u64, ConfigError> {
    if bytes == 0 {
        return Err(ConfigError::OutOfRange {
            origin,
            key: "size",
            reason: "comes to less than one 4 KiB page".to_string(),
        });
    }
    Ok(bytes)
}

fn merge_store(
    args: &StoreOptions,
    section: &DeviceSection,
    file: &ConfigFile,
    ram_bytes: u64,
) -> Result<StoreSettings, ConfigError> {
    let zstd_level = pick(args.zstd_level, section.zstd_level, DEFAULT_ZSTD_LEVEL);
    let levels = zstd::compression_level_range();
    check_range(
        "zstd-level",
        zstd_level,
        *levels.start(),
        *levels.end(),
        args.zstd_level.is_some(),
        section.zstd_level,
        file,
    )?;
    if let Err(reason) = values::zstd_level_named(zstd_level) {
        // The file's value was refused as it was read: only the flag gets here.
        return Err(ConfigError::OutOfRange {
            origin: "command line (--zstd-level)".to_string(),
            key: "zstd-level",
            reason,
        });
    }
    let algorithm =
        pick(args.algorithm, section.algorithm, DEFAULT_ALGORITHM).with_level(zstd_level);
    let forced_backend = pick(args.backend, section.backend, BackendChoice::Auto).forced();
    // Refused here, with the line that asks for it, and not first by the store at start-up:
    // the generator would write a swap unit for it, and a standby or restart that reads the
    // file again would fail to resume a device in use.
    if forced_backend == Some(Backend::Gpu) && algorithm != Algorithm::Lz4 {
        return Err(ConfigError::OutOfRange {
            origin: origin("backend", args.backend.is_some(), section.backend, file),
            key: "backend",
            reason: "is gpu, which compresses LZ4 only: set algorithm = lz4 (or another backend)"
                .to_string(),
        });
    }
    let batched = switch_on(args.no_batched, section.batched);
    let batch_threshold = args
        .batch_threshold
        .or(section.batch_threshold.map(|setting| setting.value));
    if let Some(threshold) = batch_threshold {
        check_range(
            "batch-threshold",
            threshold,
            1,
            MAX_BATCH_THRESHOLD,
            args.batch_threshold.is_some(),
            section.batch_threshold,
            file,
        )?;
    }
    let flush_timeout_ms = pick(
        args.flush_timeout_ms,
        section.flush_timeout_ms,
        DEFAULT_FLUSH_TIMEOUT_MS,
    );
    check_range(
        "flush-timeout-ms",
        flush_timeout_ms,
        1,
        MAX_FLUSH_TIMEOUT_MS,
        args.flush_timeout_ms.is_some(),
        section.flush_timeout_ms,
        file,
    )?;
    let mem_limit = match pick(args.mem_limit, section.mem_limit, MemLimit::Unlimited) {
        MemLimit::Unlimited => None,
        MemLimit::Size(expr) => {
            let bytes = expr.evaluate(ram_bytes);
            if bytes < PAGE_SIZE as u64 {
                return Err(ConfigError::OutOfRange {
                    origin: origin(
                        "mem-limit",
                        args.mem_limit.is_some(),
                        section.mem_limit,
                        file,
                    ),
                    key: "mem-limit",
                    reason: "comes to less than one 4 KiB page".to_string(),
                });
            }
            Some(bytes)
        }
    };
    let recompress = merge_recompress(args, section, file, algorithm)?;
    Ok(StoreSettings {
        algorithm,
        forced_backend,
        batched,
        batch_threshold,
        flush_timeout: Duration::from_millis(flush_timeout_ms),
        mem_limit,
        recompress,
    })
}

/// `recompress` and `recompress-idle`. Asked for explicitly, a recompression that cannot make
/// pages of `algorithm` smaller is an error; without it, `default_recompress`.
fn merge_recompress(
    args: &StoreOptions,
    section: &DeviceSection,
    file: &ConfigFile,
    algorithm: Algorithm,
) -> Result<Option<RecompressConfig>, ConfigError> {
    let idle = pick(
        args.recompress_idle,
        section.recompress_idle,
        DEFAULT_RECOMPRESS_IDLE,
    );
    if !(MIN_RECOMPRESS_IDLE..=MAX_RECOMPRESS_IDLE).contains(&idle) {
        return Err(ConfigError::OutOfRange {
            origin: origin(
                "recompress-idle",
                args.recompress_idle.is_some(),
                section.recompress_idle,
                file,
            ),
            key: "recompress-idle",
            reason: format!(
                "is {}; it must be from {} to {}",
                human_duration(idle),
                human_duration(MIN_RECOMPRESS_IDLE),
                human_duration(MAX_RECOMPRESS_IDLE)
            ),
        });
    }
    let (choice, origin) = match (args.recompress, section.recompress) {
        (Some(choice), _) => (choice, "command line (--recompress)".to_string()),
        (None, Some(setting)) => (setting.value, file.origin(setting.line)),
        (None, None) => return Ok(default_recompress(algorithm, idle)),
    };
    let config = recompress_config(choice, idle, algorithm);
    match config {
        None if choice != RecompressChoice::Off => Err(ConfigError::OutOfRange {
            origin,
            key: "recompress",
            reason: format!(
                "is {}, which cannot make pages stored with {} smaller: use a higher zstd \
                     level, or off",
                choice.name(),
                algorithm
            ),
        }),
        _ => Ok(config),
    }
}
