//! Sizes and durations as users write and read them: `8G`, `512M`, `1.5G`, `30s`, `5m`. A
//! leaf: it knows nothing else of the program.

#![forbid(unsafe_code)]

/// Parse a size with an optional K/M/G/T suffix (powers of 1024; `KiB`/`KB` spellings and
/// lower case accepted), rounded up to a multiple of 4 KiB. A fraction is taken as
/// `human_size` and zramctl write it (`1.5G`), up to 9 decimals. Zero is rejected.
pub fn parse_size(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let number_end = text
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(text.len());
    let (number, suffix) = text.split_at(number_end);
    let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
    if whole.is_empty() || fraction.contains('.') || number.ends_with('.') {
        return Err(format!(
            "bad size '{text}': expected a number like 8G, 1.5G or 512M"
        ));
    }
    if fraction.len() > 9 {
        return Err(format!(
            "bad size '{text}': at most 9 digits after the point"
        ));
    }
    let whole: u64 = whole
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
    // The fraction's bytes, rounded up: 9 decimals of at most 2^40 fit a u128 many times over.
    let fraction_bytes = if fraction.is_empty() {
        0
    } else {
        let numerator: u128 = fraction
            .parse()
            .map_err(|_| format!("bad size '{text}': bad fraction"))?;
        let denominator = 10u128.pow(u32::try_from(fraction.len()).unwrap_or(9));
        u64::try_from((numerator << shift).div_ceil(denominator)).unwrap_or(u64::MAX)
    };
    let bytes = whole
        .checked_mul(1u64 << shift)
        .and_then(|b| b.checked_add(fraction_bytes))
        .and_then(|b| b.checked_add(4095))
        .map(|b| b & !4095)
        .ok_or_else(|| format!("bad size '{text}': too large"))?;
    if bytes == 0 {
        return Err(format!("bad size '{text}': must be greater than zero"));
    }
    Ok(bytes)
}

/// Parse a duration: a whole number with a unit `ms`, `s`, `m`, `h` or `d` (`30s`, `5m`,
/// `500ms`); a bare number is seconds.
pub fn parse_duration(text: &str) -> Result<std::time::Duration, String> {
    let text = text.trim();
    let digits_end = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (digits, unit) = text.split_at(digits_end);
    let number: u64 = digits.parse().map_err(|_| {
        if digits.is_empty() {
            format!("bad duration '{text}': expected a number like 30s or 5m")
        } else {
            format!("bad duration '{text}': too long")
        }
    })?;
    let millis_per_unit: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "ms" => 1,
        "" | "s" => 1000,
        "m" | "min" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        fraction if fraction.starts_with(['.', ',']) => {
            return Err(format!(
                "bad duration '{text}': whole numbers only (write 1500ms for 1.5s)"
            ))
        }
        other => {
            return Err(format!(
                "bad duration '{text}': unknown unit '{other}' (use ms, s, m, h or d)"
            ))
        }
    };
    number
        .checked_mul(millis_per_unit)
        .map(std::time::Duration::from_millis)
        .ok_or_else(|| format!("bad duration '{text}': too long"))
}

/// A duration the way `parse_duration` reads it: `30s`, `5m`, `1500ms`.
pub fn human_duration(duration: std::time::Duration) -> String {
    let millis = duration.as_millis();
    match millis {
        m if m % 3_600_000 == 0 && m > 0 => format!("{}h", m / 3_600_000),
        m if m % 60_000 == 0 && m > 0 => format!("{}m", m / 60_000),
        m if m % 1000 == 0 => format!("{}s", m / 1000),
        m => format!("{m}ms"),
    }
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

/// `duration` in nanoseconds as a `u64`, saturating (past 584 years): the clocks and periods
/// the I/O path keeps in atomic words.
pub fn nanos(duration: std::time::Duration) -> u64 {
    u64::try_from(duration.as_nanos()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse_with_units_and_print_back() {
        use std::time::Duration;
        for (text, want) in [
            ("30s", Duration::from_secs(30)),
            ("30", Duration::from_secs(30)),
            ("5m", Duration::from_secs(300)),
            ("2h", Duration::from_secs(7200)),
            ("1d", Duration::from_secs(86_400)),
            ("500ms", Duration::from_millis(500)),
            (" 10 s ", Duration::from_secs(10)),
        ] {
            assert_eq!(parse_duration(text), Ok(want), "{text}");
        }
        for bad in ["", "s", "1.5s", "10x", "-3s", "99999999999999999999d"] {
            assert!(parse_duration(bad).is_err(), "{bad}");
        }
        for (bad, says) in [
            ("1.5s", "whole numbers only"),
            ("99999999999999999999s", "too long"),
            ("10x", "unknown unit"),
        ] {
            let error = parse_duration(bad).expect_err(bad);
            assert!(error.contains(says), "{bad}: {error}");
        }
        for text in ["30s", "5m", "2h", "1500ms", "0s"] {
            assert_eq!(human_duration(parse_duration(text).unwrap()), text);
        }
    }

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
            ("1.5G", Ok(3 << 29)),
            ("0.5M", Ok(512 << 10)),
            ("2.25k", Ok(4096)),
            ("1.0", Ok(4096)),
            ("0.0G", Err(())),
            (".5G", Err(())),
            ("1.G", Err(())),
            ("1.2.3G", Err(())),
            ("1.0000000001G", Err(())),
        ];
        for (text, want) in cases {
            assert_eq!(
                parse_size(text).map_err(|_| ()),
                *want,
                "parse_size({text:?})"
            );
        }
        let error = parse_size("1.0000000001G").unwrap_err();
        assert!(
            error.contains("at most 9 digits after the point"),
            "{error}"
        );
    }

    #[test]
    fn human_sizes_read_like_zramctl() {
        assert_eq!(human_size(0), "0B");
        assert_eq!(human_size(4096), "4K");
        assert_eq!(human_size(1536 << 20), "1.5G");
        assert_eq!(parse_size(&human_size(1536 << 20)), Ok(1536 << 20));
        assert_eq!(human_size(8 << 30), "8G");
    }
}
