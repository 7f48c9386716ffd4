//! Where a request's time goes in the daemon: per op, the time from its completion reaching
//! the queue thread to its commit being queued (serving it, and waiting behind the requests
//! the same ring wait returned before it), and how many requests each ring wait returns.
//! Lock-free log-scale histograms, cheap enough for every request, kept for operators
//! (`trueno-ublk stat`).

#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Serialize};

use super::io::Op;

/// Buckets of a histogram: bucket `i` counts values in `[2^i, 2^(i+1))` (0 counts in bucket 0),
/// so 40 buckets reach about 18 minutes in nanoseconds.
pub const BUCKETS: usize = 40;

/// A histogram that threads record into without a lock.
pub struct Histogram {
    buckets: [AtomicU64; BUCKETS],
}

impl Default for Histogram {
    fn default() -> Self {
        Self {
            buckets: std::array::from_fn(|_| AtomicU64::new(0)),
        }
    }
}

impl Histogram {
    pub fn record(&self, value: u64) {
        let log2 = value.checked_ilog2().unwrap_or(0);
        let bucket = usize::try_from(log2).map_or(BUCKETS - 1, |b| b.min(BUCKETS - 1));
        self.buckets[bucket].fetch_add(1, Ordering::Relaxed);
    }

    pub fn snapshot(&self) -> Buckets {
        Buckets(
            self.buckets
                .iter()
                .map(|b| b.load(Ordering::Relaxed))
                .collect(),
        )
    }
}

/// A copy of a histogram's counts, bucket `i` holding values in `[2^i, 2^(i+1))`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Buckets(pub Vec<u64>);

impl Buckets {
    pub fn count(&self) -> u64 {
        self.0.iter().sum()
    }

    /// Where the `quantile` (0..=1) of the values lies, from the bucket holding it: below its
    /// upper bound (within a factor of two), or, in the last bucket, which holds everything
    /// above the one before it, above its lower bound. `None` for an empty histogram.
    pub fn quantile_bound(&self, quantile: f64) -> Option<QuantileBound> {
        let count = self.count();
        if count == 0 {
            return None;
        }
        // The rank of the quantile's value, 1-based: ceil(quantile * count), at least 1.
        #[allow(
            clippy::cast_possible_truncation,
            clippy::cast_sign_loss,
            reason = "a quantile in 0..=1 of the count: a non-negative rank, clamped to the count"
        )]
        let rank = ((quantile.clamp(0.0, 1.0) * count as f64).ceil() as u64).clamp(1, count);
        let mut seen = 0;
        let bucket = self.0.iter().position(|&n| {
            seen += n;
            seen >= rank
        })?;
        let power = |exponent: usize| 1u64 << exponent.min(63);
        // The last bucket of these counts (a daemon of another build may keep more or fewer).
        Some(if bucket + 1 >= self.0.len() {
            QuantileBound::Above(power(bucket))
        } else {
            QuantileBound::Below(power(bucket + 1))
        })
    }
}

/// Where a quantile of a histogram's values lies (see `Buckets::quantile_bound`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QuantileBound {
    /// Below this value (at most a factor of two above the quantile).
    Below(u64),
    /// At least this value: in the last bucket, which has no upper bound.
    Above(u64),
}

/// One device's request timing, shared by its queue threads.
#[derive(Default)]
pub struct IoTiming {
    read_ns: Histogram,
    write_ns: Histogram,
    discard_ns: Histogram,
    other_ns: Histogram,
    ready_per_wait: Histogram,
    deferred: AtomicU64,
}

impl IoTiming {
    /// A request of `op` took `ns` from its completion's arrival to its commit being queued.
    pub fn record_request(&self, op: Option<Op>, ns: u64) {
        let histogram = match op {
            Some(Op::Read) => &self.read_ns,
            Some(Op::Write) => &self.write_ns,
            Some(Op::Discard | Op::WriteZeroes) => &self.discard_ns,
            Some(Op::Flush) | None => &self.other_ns,
        };
        histogram.record(ns);
    }

    /// One ring wait returned `ready` completions.
    pub fn record_wait(&self, ready: usize) {
        self.ready_per_wait
            .record(u64::try_from(ready).unwrap_or(u64::MAX));
    }

    /// A request was deferred by its handler (a write waiting for memory; see
    /// `BlockHandler::try_handle`).
    pub fn record_deferred(&self) {
        self.deferred.fetch_add(1, Ordering::Relaxed);
    }

    pub fn snapshot(&self) -> IoTimingReport {
        IoTimingReport {
            deferred: self.deferred.load(Ordering::Relaxed),
            read_ns: self.read_ns.snapshot(),
            write_ns: self.write_ns.snapshot(),
            discard_ns: self.discard_ns.snapshot(),
            other_ns: self.other_ns.snapshot(),
            ready_per_wait: self.ready_per_wait.snapshot(),
        }
    }
}

/// A copy of `IoTiming` (in `stat --json`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct IoTimingReport {
    pub read_ns: Buckets,
    pub write_ns: Buckets,
    pub discard_ns: Buckets,
    /// Flushes, and every request refused at decoding (unknown op, misaligned, out of range).
    pub other_ns: Buckets,
    pub ready_per_wait: Buckets,
    /// Requests deferred by the handler (writes that waited for memory while the queue served
    /// others); absent from an older daemon's report.
    #[serde(default)]
    pub deferred: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_land_in_their_power_of_two_bucket() {
        let h = Histogram::default();
        for value in [0, 1, 2, 3, 4, 1000, 1023, 1024, u64::MAX] {
            h.record(value);
        }
        let b = h.snapshot();
        assert_eq!(b.0.len(), BUCKETS);
        assert_eq!(b.0[0], 2, "0 and 1");
        assert_eq!(b.0[1], 2, "2 and 3");
        assert_eq!(b.0[2], 1, "4");
        assert_eq!(b.0[9], 2, "1000 and 1023");
        assert_eq!(b.0[10], 1, "1024");
        assert_eq!(
            b.0[BUCKETS - 1],
            1,
            "the largest values share the last bucket"
        );
        assert_eq!(b.count(), 9);
    }

    #[test]
    fn quantiles_are_bucket_upper_bounds() {
        let h = Histogram::default();
        assert_eq!(h.snapshot().quantile_bound(0.5), None);
        for _ in 0..99 {
            h.record(1500); // bucket 10: [1024, 2048)
        }
        h.record(100_000); // bucket 16: [65536, 131072)
        let b = h.snapshot();
        let below = |ns| Some(QuantileBound::Below(ns));
        assert_eq!(b.quantile_bound(0.5), below(2048));
        assert_eq!(b.quantile_bound(0.99), below(2048));
        assert_eq!(b.quantile_bound(1.0), below(131_072));
        assert_eq!(b.quantile_bound(0.0), below(2048));
        // The last bucket has no upper bound: what lands there is above its lower one.
        h.record(u64::MAX);
        assert_eq!(
            h.snapshot().quantile_bound(1.0),
            Some(QuantileBound::Above(1 << (BUCKETS - 1)))
        );
    }

    #[test]
    fn requests_are_counted_per_op() {
        let t = IoTiming::default();
        t.record_request(Some(Op::Read), 5000);
        t.record_request(Some(Op::Write), 7000);
        t.record_request(Some(Op::Write), 7000);
        t.record_request(Some(Op::WriteZeroes), 1);
        t.record_request(None, 1);
        t.record_wait(3);
        let r = t.snapshot();
        assert_eq!(
            (
                r.read_ns.count(),
                r.write_ns.count(),
                r.discard_ns.count(),
                r.other_ns.count(),
                r.ready_per_wait.count()
            ),
            (1, 2, 1, 1, 1)
        );
    }
}
