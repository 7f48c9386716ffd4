//! `--compare-zram` against the machine's real zram0. These reset /sys/block/zram0 (twice) and
//! need root, so they are ignored by default: run them by hand with
//! `cargo test --test bench_zram -- --ignored --test-threads 1`.

use trueno_ublk::bench::corpus::{AlignedBuf, Corpus};
use trueno_ublk::bench::{zram, Progress};

#[test]
#[ignore = "resets /sys/block/zram0; needs root"]
fn zram_stores_and_returns_the_same_pages() {
    let corpus = Corpus::generated(4096, 3);
    let mut scratch = AlignedBuf::zeroed(corpus.bytes().len());
    for streams in [1, 2] {
        let report =
            zram::compare(&corpus, &mut scratch, streams, "lz4", &Progress::hidden()).unwrap();
        assert_eq!(report.algorithm, "lz4");
        assert_eq!(report.streams, streams);
        assert_eq!(report.orig_data_size, 16 << 20);
        assert!(report.write_gbps > 0.0 && report.read_gbps > 0.0);
        assert!(report.ratio > 1.5 && report.mem_ratio > 1.0, "{report:?}");
        assert!(report.same_pages > 0 && report.huge_pages > 0, "{report:?}");
        assert_eq!(scratch.as_slice(), corpus.bytes());
    }
    let mm_stat = std::fs::read_to_string("/sys/block/zram0/mm_stat").unwrap();
    let orig: u64 = mm_stat.split_whitespace().next().unwrap().parse().unwrap();
    assert_eq!(orig, 0, "zram0 not reset after the comparison");
}
