//! The configuration file's text: INI-like, one `[ublkbN]` section per device, keys named like
//! `create`'s long options. Parsing only: what the values mean is `super`'s business.

#![forbid(unsafe_code)]

use std::io;
use std::path::{Path, PathBuf};

use super::values::{
    parse_bool, parse_choice, parse_in_range, parse_size_expr, parse_zstd_level, MemLimit, SizeExpr,
};
use super::{
    AlgorithmChoice, BackendChoice, ConfigError, RecompressChoice, MAX_BATCH_THRESHOLD, MAX_DEPTH,
    MAX_FLUSH_TIMEOUT_MS, MAX_QUEUES, MAX_SWAP_PRIORITY,
};
use crate::units::{parse_duration, parse_size};

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
    pub algorithm: Option<Setting<AlgorithmChoice>>,
    pub zstd_level: Option<Setting<i32>>,
    pub backend: Option<Setting<BackendChoice>>,
    pub batched: Option<Setting<bool>>,
    pub batch_threshold: Option<Setting<usize>>,
    pub flush_timeout_ms: Option<Setting<u64>>,
    pub mem_limit: Option<Setting<MemLimit>>,
    pub recompress: Option<Setting<RecompressChoice>>,
    pub recompress_idle: Option<Setting<std::time::Duration>>,
    pub swap_priority: Option<Setting<u16>>,
    /// `swap = yes`: trueno-ublk-generator makes the device swap at boot.
    pub swap: Option<Setting<bool>>,
    /// `slot-free-probe = no`: freed swap slots come back through discards only.
    pub slot_free_probe: Option<Setting<bool>>,
    /// `user-copy = no`: a buffer per tag instead of pread/pwrite on the char device.
    pub user_copy: Option<Setting<bool>>,
    /// `oom-kill = no`: a store starved near OOM never asks the kernel's OOM killer to act.
    pub oom_kill: Option<Setting<bool>>,
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

    /// The swap priority of device `id`: its section's `swap-priority`, else the default
    /// (what the generator's swap unit and `trueno-ublk swapon` use).
    pub fn swap_priority(&self, id: u32) -> u16 {
        self.device(id)
            .and_then(|section| section.swap_priority)
            .map_or(super::DEFAULT_SWAP_PRIORITY, |setting| setting.value)
    }

    pub(super) fn origin(&self, line: usize) -> String {
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
    // A byte-order mark, which some editors on other systems write first: invisible in a
    // message, it made the first section header read as a bad line (systemd skips it too).
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
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
            let (name, after) = header
                .split_once(']')
                .ok_or_else(|| syntax(line, format!("section header '{trimmed}' lacks ']'")))?;
            if !after.trim().is_empty() {
                return Err(syntax(
                    line,
                    format!(
                        "text after the section header '[{name}]': '{}' (comments go on their own line)",
                        after.trim()
                    ),
                ));
            }
            let name = name.trim();
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
            // As in systemd's files, a comment has a line of its own: a value that looks as
            // if it had one says so, not only what the value should be.
            KeyProblem::BadValue(reason)
                if value.contains(" #") || value.contains(" ;") || value.contains("\t#") =>
            {
                ConfigError::BadValue {
                    path: path.to_path_buf(),
                    line,
                    key: key.to_string(),
                    value: value.to_string(),
                    reason: format!(
                        "{reason} (comments go on a line of their own, starting with # or ;)"
                    ),
                }
            }
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
    "recompress",
    "recompress-idle",
    "swap-priority",
    "swap",
    "slot-free-probe",
    "user-copy",
    "oom-kill",
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
        "algorithm" => store(&mut section.algorithm, parse_choice(value), line),
        "zstd-level" => store(&mut section.zstd_level, parse_zstd_level(value), line),
        "backend" => store(&mut section.backend, parse_choice(value), line),
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
        "mem-limit" => store(&mut section.mem_limit, MemLimit::parse(value), line),
        "recompress" => store(
            &mut section.recompress,
            RecompressChoice::parse(value),
            line,
        ),
        "recompress-idle" => store(&mut section.recompress_idle, parse_duration(value), line),
        "swap-priority" => store(
            &mut section.swap_priority,
            parse_in_range(value, 0, MAX_SWAP_PRIORITY),
            line,
        ),
        "swap" => store(&mut section.swap, parse_bool(value), line),
        "slot-free-probe" => store(&mut section.slot_free_probe, parse_bool(value), line),
        "user-copy" => store(&mut section.user_copy, parse_bool(value), line),
        "oom-kill" => store(&mut section.oom_kill, parse_bool(value), line),
        _ => Err(KeyProblem::Unknown),
    }
}

/// `ublkb7` → 7.
fn section_id(name: &str) -> Option<u32> {
    crate::os::numbered_name(name, "ublkb")
}
