//! Parsers of the values a user writes in the configuration file: sizes (absolute or a share
//! of RAM), numbers in a range, yes/no, and named choices.

#![forbid(unsafe_code)]

use super::Choice;
use crate::codec::PAGE_SIZE;
use crate::units::parse_size;

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
    {
        return Err(bad());
    }
    if fraction.len() > 6 || whole.len() > 6 {
        return Err(format!(
            "'{text}' has more than 6 digits before or after the point"
        ));
    }
    let denominator = 10u64.pow(u32::try_from(fraction.len()).map_err(|_| bad())?);
    let digits = format!("{whole}{fraction}");
    let numerator: u64 = digits.parse().map_err(|_| bad())?;
    Ok((numerator, denominator))
}

/// A memory limit as written on the command line or in the file: a size (`512M`, `ram / 4`)
/// or `none`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemLimit {
    Unlimited,
    Size(SizeExpr),
}

impl MemLimit {
    pub fn parse(text: &str) -> Result<Self, String> {
        if text.trim().eq_ignore_ascii_case("none") {
            Ok(MemLimit::Unlimited)
        } else {
            // zram's `mem_limit` takes 0 for none: say what this program takes.
            parse_size_expr(text)
                .map(MemLimit::Size)
                .map_err(|error| format!("{error} (`none` for no limit)"))
        }
    }
}

pub(super) fn parse_in_range<T>(text: &str, min: T, max: T) -> Result<T, String>
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

pub(super) fn parse_zstd_level(text: &str) -> Result<i32, String> {
    let range = zstd::compression_level_range();
    let level = parse_in_range(text, *range.start(), *range.end())?;
    zstd_level_named(level)?;
    Ok(level)
}

/// Level 0 is refused: zstd takes it as its default, level 3, and as a number it would sort
/// below level 1 (a recompression to "0" of pages stored at 1 would look like a gain).
pub(super) fn zstd_level_named(level: i32) -> Result<(), String> {
    if level == 0 {
        return Err("0 is zstd's way of saying its default level, 3: write 3".to_string());
    }
    Ok(())
}

pub(super) fn parse_bool(text: &str) -> Result<bool, String> {
    match text.to_ascii_lowercase().as_str() {
        "yes" | "true" | "on" | "1" => Ok(true),
        "no" | "false" | "off" | "0" => Ok(false),
        _ => Err("expected yes or no".to_string()),
    }
}

/// One of the names the command line accepts for the same option.
pub(super) fn parse_choice<T: Choice>(text: &str) -> Result<T, String> {
    T::from_name(text).ok_or_else(|| format!("expected one of {}", T::names().join(", ")))
}
