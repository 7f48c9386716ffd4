//! Device settings: the boot configuration file (`/etc/trueno-ublk.conf`), merged with the
//! command line and the defaults. Precedence: command line > config file > default.
//!
//! The file is INI-like, one `[ublkbN]` section per device, keys named like `create`'s long
//! flags (see `trueno-ublk.conf.example` and the README):
//!
//! ```text
//! [ublkb0]
//! size = ram / 2          # or 8G; relative sizes are capped by max-size
//! max-size = 4G
//! algorithm = zstd
//! swap-priority = 100
//! ```
//!
//! A missing file means defaults for every device; an unknown section or key, or a bad value,
//! is an error naming the file, the line and the key. Without any size the device gets
//! zram-generator's default, min(RAM / 2, 4 GiB).

use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::Args;
use thiserror::Error;

use crate::cli::{parse_size, AlgorithmArg, BackendArg, CreateArgs, StoreArgs};
use crate::codec::{Algorithm, Backend, PAGE_SIZE};
use crate::store::StoreConfig;

/// Where the systemd units read the configuration from.
pub const DEFAULT_CONFIG_PATH: &str = "/etc/trueno-ublk.conf";

/// zram-generator's default device size is min(RAM / 2, this).
pub const DEFAULT_SIZE_CAP: u64 = 4 << 30;
pub const DEFAULT_QUEUES: u16 = 1;
/// Tags per queue: each holds a locked 64 KiB buffer, and one queue thread serves them in turn,
/// so more tags mostly lock more memory.
pub const DEFAULT_DEPTH: u16 = 32;
pub const DEFAULT_ZSTD_LEVEL: i32 = 1;
/// Pending pages per batch without a GPU: enough for every core to compress a share of each
/// flush, and with two batches only 2 MiB of locked memory (swap wants the RAM back).
pub const DEFAULT_BATCH_THRESHOLD: usize = 256;
/// Pending pages per batch for the GPU backend, which needs large batches to pay off.
pub const DEFAULT_GPU_BATCH_THRESHOLD: usize = 1000;
pub const DEFAULT_FLUSH_TIMEOUT_MS: u64 = 10;
/// zram-generator's default swap priority.
pub const DEFAULT_SWAP_PRIORITY: u16 = 100;

/// The ublk driver's limits on queues and tags per queue (`UBLK_MAX_NR_QUEUES`,
/// `UBLK_MAX_QUEUE_DEPTH`).
const MAX_QUEUES: u16 = 4096;
const MAX_DEPTH: u16 = 4096;
/// A pending batch holds this many 4 KiB pages at most (256 MiB), to keep memory bounded.
const MAX_BATCH_THRESHOLD: usize = 65536;
const MAX_FLUSH_TIMEOUT_MS: u64 = 10_000;
/// swapon(8) accepts priorities 0..=32767.
const MAX_SWAP_PRIORITY: u16 = 32767;

#[derive(Debug, Error)]
pub enum ConfigError {
    #[error("cannot read config file {}: {source}", path.display())]
    Read { path: PathBuf, source: io::Error },
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
    #[error("cannot read the RAM size from /proc/meminfo ({0}); give --size explicitly")]
    Meminfo(String),
    #[error("'{command}' failed with {status}")]
    SwaponFailed { command: String, status: String },
}

/// A size in the config file: bytes, or a fraction of RAM (`ram`, `ram / 2`, `ram * 0.25`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SizeExpr {
    Bytes(u64),
    /// `ram * numerator / denominator`.
    RamFraction {
        numerator: u64,
        denominator: u64,
    },
}

impl SizeExpr {
    /// Bytes for a machine with `ram_bytes` of RAM, rounded down to whole pages.
    pub fn evaluate(self, ram_bytes: u64) -> u64 {
        match self {
            SizeExpr::Bytes(bytes) => bytes,
            SizeExpr::RamFraction {
                numerator,
                denominator,
            } => {
                let bytes = u128::from(ram_bytes) * u128::from(numerator) / u128::from(denominator);
                let bytes = u64::try_from(bytes).unwrap_or(u64::MAX);
                bytes & !(PAGE_SIZE as u64 - 1)
            }
        }
    }
}

/// One value from the file and the line it came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Setting<T> {
    pub value: T,
    pub line: usize,
}

/// The keys of one `[ublkbN]` section; `None` where the file does not set them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DeviceSection {
    pub size: Option<Setting<SizeExpr>>,
    pub max_size: Option<Setting<u64>>,
    pub queues: Option<Setting<u16>>,
    pub depth: Option<Setting<u16>>,
    pub algorithm: Option<Setting<AlgorithmArg>>,
    pub zstd_level: Option<Setting<i32>>,
    pub backend: Option<Setting<BackendArg>>,
    pub batched: Option<Setting<bool>>,
    pub batch_threshold: Option<Setting<usize>>,
    pub flush_timeout_ms: Option<Setting<u64>>,
    /// `Some(None)`: `mem-limit = none`.
    pub mem_limit: Option<Setting<Option<SizeExpr>>>,
    pub swap_priority: Option<Setting<u16>>,
    /// `swap = yes`: trueno-ublk-generator makes the device swap at boot.
    pub swap: Option<Setting<bool>>,
}

/// A parsed configuration file.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ConfigFile {
    /// Where it was read from (for messages); empty for "no file".
    pub path: PathBuf,
    /// `(id, section)` in file order.
    pub devices: Vec<(u32, DeviceSection)>,
}

impl ConfigFile {
    /// The section `[ublkb{id}]`, if the file has one.
    pub fn device(&self, id: u32) -> Option<&DeviceSection> {
        self.devices
            .iter()
            .find(|(section_id, _)| *section_id == id)
            .map(|(_, section)| section)
    }

    fn origin(&self, line: usize) -> String {
        format!("{}:{line}", self.path.display())
    }
}

/// Read and parse `path`; a file that does not exist is an empty configuration.
pub fn load(path: &Path) -> Result<ConfigFile, ConfigError> {
    match std::fs::read_to_string(path) {
        Ok(text) => parse(&text, path),
        Err(error) if error.kind() == io::ErrorKind::NotFound => Ok(ConfigFile {
            path: path.to_path_buf(),
            devices: Vec::new(),
        }),
        Err(source) => Err(ConfigError::Read {
            path: path.to_path_buf(),
            source,
        }),
    }
}

/// Parse the text of a configuration file; `path` is only used in messages.
pub fn parse(text: &str, path: &Path) -> Result<ConfigFile, ConfigError> {
    let mut file = ConfigFile {
        path: path.to_path_buf(),
        devices: Vec::new(),
    };
    let syntax = |line: usize, message: String| ConfigError::Syntax {
        path: path.to_path_buf(),
        line,
        message,
    };
    for (index, raw) in text.lines().enumerate() {
        let line = index + 1;
        let trimmed = raw.trim();
        if trimmed.is_empty() || trimmed.starts_with('#') || trimmed.starts_with(';') {
            continue;
        }
        if let Some(header) = trimmed.strip_prefix('[') {
            let name = header
                .strip_suffix(']')
                .ok_or_else(|| syntax(line, format!("section header '{trimmed}' lacks ']'")))?
                .trim();
            let id = section_id(name).ok_or_else(|| {
                syntax(
                    line,
                    format!("unknown section [{name}]: sections name devices, like [ublkb0]"),
                )
            })?;
            if file.device(id).is_some() {
                return Err(syntax(line, format!("section [{name}] appears twice")));
            }
            file.devices.push((id, DeviceSection::default()));
            continue;
        }
        let (key, value) = trimmed
            .split_once('=')
            .ok_or_else(|| syntax(line, format!("expected 'key = value', found '{trimmed}'")))?;
        let (key, value) = (key.trim(), value.trim());
        let Some((_, section)) = file.devices.last_mut() else {
            return Err(syntax(
                line,
                format!("key '{key}' is outside a device section; start one with [ublkb0]"),
            ));
        };
        set_key(section, key, value, line).map_err(|problem| match problem {
            KeyProblem::Unknown => syntax(
                line,
                format!("unknown key '{key}' (keys: {})", KEYS.join(", ")),
            ),
            KeyProblem::Repeated => syntax(line, format!("key '{key}' is set twice")),
            KeyProblem::BadValue(reason) => ConfigError::BadValue {
                path: path.to_path_buf(),
                line,
                key: key.to_string(),
                value: value.to_string(),
                reason,
            },
        })?;
    }
    Ok(file)
}

/// The keys a device section accepts.
pub const KEYS: &[&str] = &[
    "size",
    "max-size",
    "queues",
    "depth",
    "algorithm",
    "zstd-level",
    "backend",
    "batched",
    "batch-threshold",
    "flush-timeout-ms",
    "mem-limit",
    "swap-priority",
    "swap",
];

enum KeyProblem {
    Unknown,
    Repeated,
    BadValue(String),
}

fn set_key(
    section: &mut DeviceSection,
    key: &str,
    value: &str,
    line: usize,
) -> Result<(), KeyProblem> {
    fn store<T>(
        slot: &mut Option<Setting<T>>,
        parsed: Result<T, String>,
        line: usize,
    ) -> Result<(), KeyProblem> {
        if slot.is_some() {
            return Err(KeyProblem::Repeated);
        }
        let value = parsed.map_err(KeyProblem::BadValue)?;
        *slot = Some(Setting { value, line });
        Ok(())
    }
    match key {
        "size" => store(&mut section.size, parse_size_expr(value), line),
        "max-size" => store(&mut section.max_size, parse_size(value), line),
        "queues" => store(
            &mut section.queues,
            parse_in_range(value, 1, MAX_QUEUES),
            line,
        ),
        "depth" => store(
            &mut section.depth,
            parse_in_range(value, 1, MAX_DEPTH),
            line,
        ),
        "algorithm" => store(&mut section.algorithm, parse_enum(value), line),
        "zstd-level" => store(&mut section.zstd_level, parse_zstd_level(value), line),
        "backend" => store(&mut section.backend, parse_enum(value), line),
        "batched" => store(&mut section.batched, parse_bool(value), line),
        "batch-threshold" => store(
            &mut section.batch_threshold,
            parse_in_range(value, 1, MAX_BATCH_THRESHOLD),
            line,
        ),
        "flush-timeout-ms" => store(
            &mut section.flush_timeout_ms,
            parse_in_range(value, 1, MAX_FLUSH_TIMEOUT_MS),
            line,
        ),
        "mem-limit" => store(&mut section.mem_limit, parse_mem_limit(value), line),
        "swap-priority" => store(
            &mut section.swap_priority,
            parse_in_range(value, 0, MAX_SWAP_PRIORITY),
            line,
        ),
        "swap" => store(&mut section.swap, parse_bool(value), line),
        _ => Err(KeyProblem::Unknown),
    }
}

/// `ublkb7` → 7.
fn section_id(name: &str) -> Option<u32> {
    let digits = name.strip_prefix("ublkb")?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// `8G`, `ram`, `ram / 2`, `ram * 0.25`.
pub fn parse_size_expr(text: &str) -> Result<SizeExpr, String> {
    let text = text.trim();
    let Some(rest) = text.strip_prefix("ram") else {
        return parse_size(text).map(SizeExpr::Bytes);
    };
    let rest = rest.trim();
    let fraction = if rest.is_empty() {
        Ok((1, 1))
    } else if let Some(divisor) = rest.strip_prefix('/') {
        match divisor.trim().parse::<u64>() {
            Ok(0) => Err("division by zero".to_string()),
            Ok(divisor) => Ok((1, divisor)),
            Err(_) => Err(format!("'{}' is not a whole number", divisor.trim())),
        }
    } else if let Some(factor) = rest.strip_prefix('*') {
        parse_decimal(factor.trim())
    } else {
        Err("expected a size like 8G, or ram, ram / N or ram * F".to_string())
    };
    let (numerator, denominator) = fraction?;
    if numerator == 0 {
        return Err("a size must be greater than zero".to_string());
    }
    Ok(SizeExpr::RamFraction {
        numerator,
        denominator,
    })
}

/// `0.25` → (25, 100); at most 6 decimals.
fn parse_decimal(text: &str) -> Result<(u64, u64), String> {
    let bad = || format!("'{text}' is not a number like 2 or 0.25");
    let (whole, fraction) = text.split_once('.').unwrap_or((text, ""));
    if whole.is_empty() && fraction.is_empty()
        || !whole.bytes().all(|b| b.is_ascii_digit())
        || !fraction.bytes().all(|b| b.is_ascii_digit())
        || fraction.len() > 6
        || whole.len() > 6
    {
        return Err(bad());
    }
    let denominator = 10u64.pow(fraction.len() as u32);
    let digits = format!("{whole}{fraction}");
    let numerator: u64 = digits.parse().map_err(|_| bad())?;
    Ok((numerator, denominator))
}

fn parse_mem_limit(text: &str) -> Result<Option<SizeExpr>, String> {
    if text.eq_ignore_ascii_case("none") {
        Ok(None)
    } else {
        parse_size_expr(text).map(Some)
    }
}

fn parse_in_range<T>(text: &str, min: T, max: T) -> Result<T, String>
where
    T: std::str::FromStr + PartialOrd + std::fmt::Display + Copy,
{
    let value: T = text
        .parse()
        .map_err(|_| format!("expected a whole number from {min} to {max}"))?;
    if value < min || value > max {
        return Err(format!("must be from {min} to {max}"));
    }
    Ok(value)
}

fn parse_zstd_level(text: &str) -> Result<i32, String> {
    let range = zstd::compression_level_range();
    parse_in_range(text, *range.start(), *range.end())
}

fn parse_bool(text: &str) -> Result<bool, String> {
    match text.to_ascii_lowercase().as_str() {
        "yes" | "true" | "on" | "1" => Ok(true),
        "no" | "false" | "off" | "0" => Ok(false),
        _ => Err("expected yes or no".to_string()),
    }
}

/// The values clap accepts on the command line for the same option.
fn parse_enum<T: clap::ValueEnum>(text: &str) -> Result<T, String> {
    T::from_str(text, true).map_err(|_| {
        let names: Vec<String> = T::value_variants()
            .iter()
            .filter_map(|v| v.to_possible_value().map(|p| p.get_name().to_string()))
            .collect();
        format!("expected one of {}", names.join(", "))
    })
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
            ..StoreConfig::new(size_bytes)
        }
    }

    /// `lz4`, `zstd:3` or `adaptive:1` (what `stat` shows as ALGORITHM).
    pub fn algorithm_name(&self) -> String {
        match self.algorithm {
            Algorithm::Lz4 => "lz4".to_string(),
            Algorithm::Zstd { level } => format!("zstd:{level}"),
            Algorithm::Adaptive => "adaptive".to_string(),
        }
    }

    /// `auto`, `simd`, `simd-parallel` or `gpu`.
    pub fn backend_name(&self) -> &'static str {
        match self.forced_backend {
            None => "auto",
            Some(Backend::Simd) => "simd",
            Some(Backend::SimdParallel) => "simd-parallel",
            Some(Backend::Gpu) => "gpu",
        }
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
    pub swap_priority: u16,
}

impl DeviceSettings {
    pub fn store_config(&self, with_gpu: bool) -> StoreConfig {
        self.store.store_config(self.size_bytes, with_gpu)
    }
}

/// Merge `args`, the config file it names (section `[ublkb{id}]`) and the defaults, reading the
/// RAM size from /proc/meminfo.
pub fn resolve(args: &CreateArgs) -> Result<DeviceSettings, ConfigError> {
    let file = load_for(args.config.as_deref(), args.id)?;
    resolve_with(args, &file, ram_bytes()?)
}

/// `resolve` with the file already parsed and the RAM size given (for tests).
pub fn resolve_with(
    args: &CreateArgs,
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
        swap_priority: pick(None, section.swap_priority, DEFAULT_SWAP_PRIORITY),
    })
}

/// Store settings from the command line and the defaults only (`bench`).
pub fn store_settings(args: &StoreArgs) -> Result<StoreSettings, ConfigError> {
    merge_store(args, &DeviceSection::default(), &ConfigFile::default(), 0)
}

fn load_for(path: Option<&Path>, id: Option<u32>) -> Result<ConfigFile, ConfigError> {
    match path {
        None => Ok(ConfigFile::default()),
        Some(path) if id.is_none() => Err(ConfigError::NeedsId {
            path: path.to_path_buf(),
        }),
        Some(path) => load(path),
    }
}

fn pick<T: Copy>(command_line: Option<T>, file: Option<Setting<T>>, default: T) -> T {
    command_line
        .or(file.map(|setting| setting.value))
        .unwrap_or(default)
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
    let origin = match setting {
        Some(setting) if !from_command_line => file.origin(setting.line),
        _ => format!("command line (--{key})"),
    };
    Err(ConfigError::OutOfRange {
        origin,
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
    args: &StoreArgs,
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
    let algorithm = match pick(args.algorithm, section.algorithm, AlgorithmArg::Zstd) {
        AlgorithmArg::Lz4 => Algorithm::Lz4,
        AlgorithmArg::Zstd => Algorithm::Zstd { level: zstd_level },
        AlgorithmArg::Adaptive => Algorithm::Adaptive,
    };
    let forced_backend = match pick(args.backend, section.backend, BackendArg::Auto) {
        BackendArg::Auto => None,
        BackendArg::Simd => Some(Backend::Simd),
        BackendArg::SimdParallel => Some(Backend::SimdParallel),
        BackendArg::Gpu => Some(Backend::Gpu),
    };
    let batched = !args.no_batched && section.batched.map_or(true, |s| s.value);
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
    let mem_limit = match (args.mem_limit, section.mem_limit) {
        (Some(bytes), _) => Some(bytes),
        (None, None | Some(Setting { value: None, .. })) => None,
        (
            None,
            Some(Setting {
                value: Some(expr),
                line,
            }),
        ) => {
            let bytes = expr.evaluate(ram_bytes);
            if bytes == 0 {
                return Err(ConfigError::OutOfRange {
                    origin: file.origin(line),
                    key: "mem-limit",
                    reason: "comes to less than one 4 KiB page".to_string(),
                });
            }
            Some(bytes)
        }
    };
    Ok(StoreSettings {
        algorithm,
        forced_backend,
        batched,
        batch_threshold,
        flush_timeout: Duration::from_millis(flush_timeout_ms),
        mem_limit,
    })
}

/// Total RAM from /proc/meminfo (`MemTotal`).
pub fn ram_bytes() -> Result<u64, ConfigError> {
    let text = std::fs::read_to_string("/proc/meminfo")
        .map_err(|error| ConfigError::Meminfo(error.to_string()))?;
    parse_mem_total(&text).ok_or_else(|| ConfigError::Meminfo("no MemTotal line".to_string()))
}

/// The `MemTotal:  16318412 kB` line, in bytes.
pub fn parse_mem_total(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemTotal:"))?;
    let mut words = line["MemTotal:".len()..].split_whitespace();
    let kib: u64 = words.next()?.parse().ok()?;
    match words.next() {
        Some("kB") => kib.checked_mul(1024),
        _ => None,
    }
}

/// `trueno-ublk swapon`: swapon with the configured priority, for use without systemd (the
/// units leave swapon to the generated `dev-ublkbN.swap`).
#[derive(Clone, Debug, Args)]
pub struct SwaponArgs {
    /// Device id N of /dev/ublkbN
    #[arg(long)]
    pub id: u32,
    /// Config file whose [ublkbN] section gives swap-priority (a missing file means 100)
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Print the swapon command instead of running it
    #[arg(long)]
    pub dry_run: bool,
}

/// The swapon command line for device `id`: discard on (a ublk device gets no swap-slot-free
/// notification, so discard is how freed slots give memory back) and the priority. Short
/// options, because util-linux and busybox both accept them.
pub fn swapon_command(id: u32, priority: u16) -> Vec<String> {
    vec![
        "swapon".to_string(),
        "-d".to_string(),
        "-p".to_string(),
        priority.to_string(),
        format!("/dev/ublkb{id}"),
    ]
}

/// Enable `/dev/ublkb{id}` as swap with the configured priority (or print the command).
pub fn swapon(args: &SwaponArgs) -> Result<(), ConfigError> {
    let file = load_for(args.config.as_deref(), Some(args.id))?;
    let priority = pick(
        None,
        file.device(args.id).and_then(|s| s.swap_priority),
        DEFAULT_SWAP_PRIORITY,
    );
    let command = swapon_command(args.id, priority);
    if args.dry_run {
        println!("{}", command.join(" "));
        return Ok(());
    }
    // swapon(2) directly: busybox's swapon (in minimal systems) has no priority option.
    let path = format!("/dev/ublkb{}", args.id);
    let c_path = std::ffi::CString::new(path.clone()).map_err(|_| ConfigError::SwaponFailed {
        command: command.join(" "),
        status: "bad path".into(),
    })?;
    crate::ublk::sys::swapon(&c_path, priority).map_err(|error| ConfigError::SwaponFailed {
        command: command.join(" "),
        status: error.to_string(),
    })
}
