//! `trueno-ublk stat`'s table and JSON.

#![forbid(unsafe_code)]

use std::path::Path;

use serde::Serialize;

use super::{DeviceReport, Probe};
use crate::ublk::timing::{Buckets, QuantileBound};
use crate::units::human_size;

/// How `render` prints.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StatFormat {
    /// Human-readable sizes.
    Table,
    /// Sizes in bytes.
    RawTable,
    Json,
}

/// The table's columns: zramctl's, then ours.
pub const COLUMNS: &[&str] = &[
    "NAME",
    "DISKSIZE",
    "DATA",
    "COMPR",
    "ALGORITHM",
    "STREAMS",
    "ZERO-PAGES",
    "TOTAL",
    "MEM-LIMIT",
    "MEM-USED",
    "COMP-RATIO",
    "PAGES-SIMD",
    "PAGES-PARALLEL",
    "PAGES-GPU",
    "RECOMPRESS",
    "MEM-SHORT",
    "PAGES-LZ4",
    "PAGES-ZSTD",
    "RECOMPRESSED",
    "RECOMP-SAVED",
    "RECOMP-CPU",
    "FLUSHES",
    "READ-ERRS",
    "WRITE-ERRS",
    "LOST",
    "CSUM-ERRS",
    "RSS",
    "IDLE-RSS",
    "READ-P50",
    "READ-P99",
    "WRITE-P50",
    "WRITE-P99",
    "SLOT-FREES",
    "GPU",
];

/// Columns printed left-aligned (the others are numbers).
const TEXT_COLUMNS: &[&str] = &["NAME", "ALGORITHM", "RECOMPRESS", "MEM-SHORT", "GPU"];

/// The output of `stat` for these probes.
pub fn render(probes: &[Probe], format: StatFormat) -> String {
    if format == StatFormat::Json {
        return render_json(probes);
    }
    let reports: Vec<&DeviceReport> = probes
        .iter()
        .filter_map(|probe| match probe {
            Probe::Live(report) => Some(report.as_ref()),
            Probe::Unreachable { .. } => None,
        })
        .collect();
    let mut out = String::new();
    if reports.is_empty() {
        // Sockets whose daemons did not answer are said below, each with its reason: a
        // daemon alive but stuck is no "no running device".
        out.push_str(if probes.is_empty() {
            "no running trueno-ublk devices\n"
        } else {
            "no trueno-ublk device answered\n"
        });
    } else {
        let size = |bytes: u64| match format {
            StatFormat::RawTable => bytes.to_string(),
            _ => human_size(bytes),
        };
        let mut rows = vec![COLUMNS.iter().map(|c| c.to_string()).collect::<Vec<_>>()];
        for report in reports {
            let s = &report.store;
            rows.push(vec![
                report.device.clone(),
                size(report.disksize),
                size(s.orig_bytes),
                size(s.compr_bytes),
                report.algorithm.clone(),
                report.queues.to_string(),
                // zram's same_pages: every same-filled page, zero pages included.
                s.same_pages.to_string(),
                size(report.total_bytes()),
                size(s.mem_limit),
                size(s.mem_used),
                report
                    .comp_ratio()
                    .map_or_else(|| "-".to_string(), |ratio| format!("{ratio:.2}")),
                s.pages_simd.to_string(),
                s.pages_simd_parallel.to_string(),
                s.pages_gpu.to_string(),
                report.recompress.clone(),
                if s.memory_short { "yes" } else { "no" }.to_string(),
                s.pages_lz4.to_string(),
                s.pages_zstd.to_string(),
                s.recompressed_pages.to_string(),
                size(s.recompress_saved_bytes),
                format!("{:.1}s", s.recompress_cpu_ns as f64 / 1e9),
                s.batch_flushes.to_string(),
                s.failed_reads.to_string(),
                s.failed_writes.to_string(),
                s.lost_pages.to_string(),
                s.checksum_failures.to_string(),
                size(report.memory.rss_bytes),
                size(report.memory.idle_rss_bytes),
                latency(&report.io.read_ns, 0.5),
                latency(&report.io.read_ns, 0.99),
                latency(&report.io.write_ns, 0.5),
                latency(&report.io.write_ns, 0.99),
                slot_frees(report),
                report.gpu.clone(),
            ]);
        }
        out.push_str(&format_table(&rows));
    }
    for probe in probes {
        if let Probe::Unreachable { id, socket, reason } = probe {
            out.push_str(&format!("ublkb{id}: {reason} ({})\n", socket.display()));
        }
    }
    out
}

/// Swap slots freed through the probe, or `off` (`-` from a daemon that predates it).
fn slot_frees(report: &DeviceReport) -> String {
    let stats = &report.slot_frees;
    if stats.attached {
        stats.slots.to_string()
    } else if stats.detail.is_empty() {
        "-".to_string()
    } else {
        "off".to_string()
    }
}

/// A request-time quantile as the bucket's upper bound (a power of two of ns) rounded up to
/// whole µs (`<=66us` for 2^16 ns), or in the last bucket its lower bound (`>549755ms`), `-`
/// with no requests.
fn latency(buckets: &Buckets, quantile: f64) -> String {
    match buckets.quantile_bound(quantile) {
        None => "-".to_string(),
        Some(QuantileBound::Below(ns)) => format!("<={}us", ns.div_ceil(1000)),
        Some(QuantileBound::Above(ns)) => format!(">{}ms", ns / 1_000_000),
    }
}

fn format_table(rows: &[Vec<String>]) -> String {
    let widths: Vec<usize> = (0..COLUMNS.len())
        .map(|column| rows.iter().map(|row| row[column].len()).max().unwrap_or(0))
        .collect();
    let mut out = String::new();
    for row in rows {
        let last = row.len() - 1;
        for (column, cell) in row.iter().enumerate() {
            let width = widths[column];
            if TEXT_COLUMNS.contains(&COLUMNS[column]) {
                if column == last {
                    out.push_str(cell);
                } else {
                    out.push_str(&format!("{cell:<width$}"));
                }
            } else {
                out.push_str(&format!("{cell:>width$}"));
            }
            out.push(if column == last { '\n' } else { ' ' });
        }
    }
    out
}

#[derive(Serialize)]
struct JsonOutput<'a> {
    devices: Vec<JsonDevice<'a>>,
    unreachable: Vec<JsonUnreachable<'a>>,
}

#[derive(Serialize)]
struct JsonDevice<'a> {
    #[serde(flatten)]
    report: &'a DeviceReport,
    total: u64,
    comp_ratio: Option<f64>,
}

#[derive(Serialize)]
struct JsonUnreachable<'a> {
    id: u32,
    socket: &'a Path,
    reason: &'a str,
}

fn render_json(probes: &[Probe]) -> String {
    let mut output = JsonOutput {
        devices: Vec::new(),
        unreachable: Vec::new(),
    };
    for probe in probes {
        match probe {
            Probe::Live(report) => output.devices.push(JsonDevice {
                report,
                total: report.total_bytes(),
                comp_ratio: report.comp_ratio(),
            }),
            Probe::Unreachable { id, socket, reason } => output.unreachable.push(JsonUnreachable {
                id: *id,
                socket,
                reason,
            }),
        }
    }
    let mut text = serde_json::to_string_pretty(&output).unwrap_or_default();
    text.push('\n');
    text
}
